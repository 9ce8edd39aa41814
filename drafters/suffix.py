"""Suffix decoding (`suffix`): draft what followed earlier occurrences of the sequence's end, in
its own tokens and in recent requests' outputs, as a tree scored by how often each came.

As in SuffixDecoding (Oliaro et al., 2024): the longest suffix of the sequence (up to
`MAX_MATCH` tokens) found in the sequence itself, and the longest found in a cache of recent
outputs; the continuations of each one's latest occurrences, as a distribution per source, mixed
in proportion to the two match lengths (a request's own prompt knows its values, other requests'
outputs know the shape of an answer) and merged into a trie whose nodes weigh the continuations
through them. The drafted tree is the weightiest nodes (each at least `MIN_PROBABILITY` of the
whole), each continuation at most `DEPTH_PER_MATCHED` times its match's length plus
`DEPTH_BEYOND_MATCH` tokens deep, so a long match drafts deep and a one-token match a few tokens.
No weights to load, and nothing the target computes: token ids alone.

The corpora are int32 arrays searched with numpy: every occurrence of the last token (the
cache keeps its places sorted by token), narrowed a token further back while they are many, the
few left compared with the sequence's end at once; the longest agreement wins. The
cross-request cache (`OutputCache`) keeps whole outputs up to a token limit and forgets the least
recently used (drafted from, or added) first; a request may keep its output out of it
(`SpeculationParams.share_output`). What its guesses are worth is learned as n-gram lookup
learns it (`drafters.ngram.GuessScores`), by kind of match: how long, how many occurrences agree.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import torch

from drafters.base import Commit, Draft, Drafter, DraftRequest, Ended, Estimates, Observes
from drafters.ngram import GUESS_DEPTH, Guess, Guesses, GuessScores
from drafters.spec import SUFFIX_CACHE_TOKENS
from specserve.tree import TokenTree

SEPARATOR = -1  # between cached outputs (and over forgotten ones): no match crosses it
MAX_MATCH = 32  # tokens of the sequence's end matched at most
MAX_OCCURRENCES = 32  # latest occurrences of the match whose continuations make the tree
INDEX_TAIL = 4096  # cached tokens past the sorted index scanned at a lookup at least before it is redone
WIDE_MATCH = 64  # occurrences above which a match is narrowed a token at a time before the rest at once
MIN_PROBABILITY = 0.1  # a drafted node's share of the occurrences at least
# How deep a match's continuations go: 2 x its length + 2 tokens, where as deep as the match is
# long stopped most trees of the repetitive workload at 3-6 nodes though about half were
# accepted whole; how often the deeper tokens come true is learned per kind of match
# (GuessScores), and the policy drafts them only where that pays (docs/design.md, "Suffix decoding").
DEPTH_PER_MATCHED = 2
DEPTH_BEYOND_MATCH = 2
# Kinds of match for scoring guesses: match length (1, 2, 3-4, 5-8, 9-16, 17+) x agreement
# (one occurrence; several, all followed alike; several that differ).
LENGTH_BOUNDS = (1, 2, 4, 8, 16)
AGREEMENT = 3


class TokenArray:
    """A growing int32 token array (appends amortized by doubling), for numpy to search."""

    def __init__(self, capacity: int = 256):
        self._data = np.empty(capacity, dtype=np.int32)
        self.size = 0

    @property
    def tokens(self) -> np.ndarray:
        return self._data[: self.size]

    @property
    def capacity_bytes(self) -> int:
        return self._data.nbytes

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        end = self.size + len(tokens)
        if end > len(self._data):
            grown = np.empty(max(end, 2 * len(self._data)), dtype=np.int32)
            grown[: self.size] = self.tokens
            self._data = grown
        self._data[self.size : end] = tokens
        self.size = end


@dataclass
class Match:
    """Where the sequence's last `length` tokens occurred before: the positions right after each
    occurrence (oldest first), in `corpus`."""

    length: int
    after: np.ndarray
    corpus: np.ndarray

    def continuations(self, depth: int) -> list[list[int]]:
        """What followed the latest `MAX_OCCURRENCES` occurrences, `depth` tokens each at most
        (cut at a separator or the corpus's end), oldest first."""
        starts = self.after[-MAX_OCCURRENCES:]
        index = starts[:, None] + np.arange(depth)
        rows = self.corpus[np.minimum(index, len(self.corpus) - 1)]
        rows[index >= len(self.corpus)] = SEPARATOR
        out = []
        for row in rows.tolist():
            cut = row.index(SEPARATOR) if SEPARATOR in row else depth
            out.append(row[:cut])
        return out


def longest_match(corpus: np.ndarray, query: Sequence[int], max_match: int = MAX_MATCH,
                  index: TokenIndex | None = None) -> Match | None:
    """The longest suffix of `query` (up to `max_match` tokens) that occurs in `corpus` followed by
    a token, with every occurrence of it (None: not even the last token occurs). `index`: the
    corpus's places sorted by token, if kept (else the corpus is scanned for the last token).
    One call of our C++ search where the kernels are built, else numpy (`numpy_longest_match`)."""
    if not len(query) or len(corpus) < 2:
        return None
    search = _native_search()
    if search is None:
        occurrences = None if index is None else index.occurrences(corpus, query[-1])
        return numpy_longest_match(corpus, query, max_match, occurrences)
    index = index or NO_INDEX
    length, after = search(torch.from_numpy(corpus), torch.from_numpy(np.asarray(query[-max_match:], dtype=np.int32)),
                           max_match, index.places_tensor, index.by_token_tensor, index.indexed)
    return Match(length, after.numpy(), corpus) if length else None


def numpy_longest_match(corpus: np.ndarray, query: Sequence[int], max_match: int = MAX_MATCH,
                        occurrences: np.ndarray | None = None) -> Match | None:
    """`longest_match` in numpy (where the kernels cannot be built). `occurrences`: where the last
    token is in `corpus`, ascending, if known (else the corpus is scanned for it)."""
    if not len(query) or len(corpus) < 2:
        return None
    if occurrences is None:
        after = np.flatnonzero(corpus[:-1] == query[-1]) + 1
    else:
        after = occurrences[occurrences < len(corpus) - 1]
        after = after[corpus[after] == query[-1]] + 1  # a place since forgotten holds a separator
    after = after[corpus[after] != SEPARATOR]
    if not len(after):
        return None
    length, limit = 1, min(max_match, len(query))
    while len(after) > WIDE_MATCH and length < limit:  # many occurrences: narrow them a token at a time
        before = after - length - 1
        keep = before >= 0
        keep[keep] = corpus[before[keep]] == query[-length - 1]
        if not keep.any():
            return Match(length, after, corpus)
        after, length = after[keep], length + 1
    if length == limit:
        return Match(length, after, corpus)
    # The few left: their preceding tokens against the query's all at once (a few numpy calls
    # whatever the match's length, where a round per token cost a long match 30 rounds).
    before = after[:, None] - np.arange(length + 1, limit + 1)
    wanted = np.asarray(query[-limit:-length][::-1], dtype=corpus.dtype)
    same = (before >= 0) & (corpus[np.maximum(before, 0)] == wanted)
    extra = np.where(same.all(axis=1), limit - length, same.argmin(axis=1))  # leading agreements each
    longest = int(extra.max())
    return Match(length + longest, after[extra == longest], corpus)


class TokenIndex:
    """A corpus's places sorted by token (stably: each token's ascending) up to `indexed`: a full
    cache is 2^18 tokens, and scanning it all for the last token took most of a lookup. Places
    after `indexed` are scanned."""

    def __init__(self, places: np.ndarray, by_token: np.ndarray, indexed: int):
        self.places, self.by_token, self.indexed = places, by_token, indexed
        self.places_tensor, self.by_token_tensor = torch.from_numpy(places), torch.from_numpy(by_token)  # shared memory

    @classmethod
    def of(cls, corpus: np.ndarray) -> TokenIndex:
        places = np.argsort(corpus, kind="stable").astype(np.int32)
        return cls(places, corpus[places], len(corpus))

    @property
    def nbytes(self) -> int:
        return self.places.nbytes + self.by_token.nbytes

    def occurrences(self, corpus: np.ndarray, token: int) -> np.ndarray:
        """Where `token` was put in `corpus`, ascending (places since forgotten too)."""
        first, end = np.searchsorted(self.by_token, token, "left"), np.searchsorted(self.by_token, token, "right")
        tail = np.flatnonzero(corpus[self.indexed :] == token) + self.indexed
        return np.concatenate([self.places[first:end], tail])


NO_INDEX = TokenIndex(np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int32), 0)


@cache
def _native_search() -> Callable | None:
    """Our C++ search (`kernels/cpu/suffix_match.cpp`), where the kernels build here."""
    from kernels import native

    try:
        return native.op("suffix_match")
    except native.KernelBuildError:
        return None


class OutputCache:
    """Recent requests' outputs, searchable as one corpus, at most `max_tokens` tokens of them:
    the least recently used output (drafted from, or added) is forgotten first."""

    def __init__(self, max_tokens: int = SUFFIX_CACHE_TOKENS):
        if max_tokens < 0:
            raise ValueError(f"the suffix cache's size must be >= 0 tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tokens = 0  # of the outputs kept now
        self._array = TokenArray()
        self._outputs: OrderedDict[int, tuple[int, int]] = OrderedDict()  # key -> (start, length), LRU first
        self._starts: list[int] = []  # every output's start in the array, ascending (forgotten ones too)
        self._keys: list[int] = []  # and its key
        self._index = NO_INDEX
        self.version = 0  # changes whenever what it holds does

    def __len__(self) -> int:
        return len(self._outputs)

    def __contains__(self, key: int) -> bool:
        return key in self._outputs

    @property
    def corpus(self) -> np.ndarray:
        return self._array.tokens

    @property
    def nbytes(self) -> int:
        """Its memory: the token array (its capacity) and the index of it."""
        return self._array.capacity_bytes + self._index.nbytes

    def add(self, key: int, tokens: Sequence[int]) -> None:
        """Keep `tokens` as output `key` (replacing what it held) as the most recently used."""
        self.forget(key)
        tokens = list(tokens)[-self.max_tokens :] if self.max_tokens else []
        if not tokens:
            return
        if self._array.size > 2 * self.max_tokens:  # mostly forgotten outputs: pack the kept ones
            self._compact()
        self._append(key, tokens)
        self.version += 1
        while self.tokens > self.max_tokens:
            self.forget(next(iter(self._outputs)))

    def forget(self, key: int) -> None:
        place = self._outputs.pop(key, None)
        if place is not None:
            start, length = place
            self._array.tokens[start : start + length] = SEPARATOR  # never matched again
            self.tokens -= length
            self.version += 1

    def match(self, query: Sequence[int]) -> Match | None:
        """`longest_match` of `query` in what the cache holds."""
        if not len(query):
            return None
        corpus = self.corpus
        if len(corpus) - self._index.indexed > max(INDEX_TAIL, self._index.indexed // 4):
            self._index = TokenIndex.of(corpus)
        return longest_match(corpus, query, index=self._index)

    def used(self, positions: np.ndarray) -> None:
        """The outputs holding these corpus positions were drafted from: the most recently used now."""
        for position in set(positions.tolist()):
            key = self._keys[bisect.bisect_right(self._starts, position) - 1]
            if key in self._outputs:
                self._outputs.move_to_end(key)

    def _append(self, key: int, tokens: Sequence[int]) -> None:
        start = self._array.size
        self._outputs[key] = (start, len(tokens))
        self._starts.append(start)
        self._keys.append(key)
        self._array.extend([*tokens, SEPARATOR])
        self.tokens += len(tokens)

    def _compact(self) -> None:
        kept = [(key, self._array.tokens[start : start + length].tolist()) for key, (start, length) in
                sorted(self._outputs.items(), key=lambda item: item[1][0])]
        order = list(self._outputs)
        self._array, self._starts, self._keys, self._outputs, self.tokens = TokenArray(), [], [], OrderedDict(), 0
        self._index = NO_INDEX
        for key, tokens in kept:
            self._append(key, tokens)
        for key in order:  # the same recency as before
            self._outputs.move_to_end(key)
        self.version += 1


class Trie:
    """Continuations merged by shared prefixes, each weighted; a node weighs what the continuations
    through it do. Node 0 is the root (the sequence's last token); nodes are numbered parents first."""

    def __init__(self, root: int, rows: list[list[int]], weights: list[float]):
        self.rows = len(rows)
        self.token, self.parent, self.depth = [root], [-1], [0]
        self.weight, self.latest = [float(sum(weights))], [len(rows)]  # and the latest continuation's index
        self.children: list[dict[int, int]] = [{}]
        merged: dict[tuple[int, ...], tuple[float, int]] = {}  # a continuation -> (weight, latest index)
        for r, (row, w) in enumerate(zip(rows, weights, strict=True)):
            weight, _ = merged.get(tuple(row), (0.0, 0))
            merged[tuple(row)] = (weight + w, r)
        for row, (weight, latest) in merged.items():  # repetitive text repeats whole continuations
            node = 0
            for tok in row:
                child = self.children[node].get(tok)
                if child is None:
                    child = len(self.weight)
                    self.children[node][tok] = child
                    self.children.append({})
                    self.token.append(tok)
                    self.parent.append(node)
                    self.depth.append(self.depth[node] + 1)
                    self.weight.append(0.0)
                    self.latest.append(latest)
                self.weight[child] += weight
                self.latest[child] = max(self.latest[child], latest)
                node = child

    def _rank(self, node: int) -> tuple[float, int, int]:
        return -self.weight[node], self.depth[node], -self.latest[node]

    def spine(self) -> list[int]:
        """The path the most weight follows (ties: the latest continuation's)."""
        path, node = [], 0
        while self.children[node]:
            node = min(self.children[node].values(), key=self._rank)
            path.append(self.token[node])
        return path

    def tree(self, budget: int, max_depth: int) -> TokenTree:
        """Its `budget` weightiest nodes down to `max_depth`, each with at least `MIN_PROBABILITY`
        of the weight: a node weighs at most what its parent does, so ranking by weight (then
        depth) keeps every parent ahead of its children."""
        floor = MIN_PROBABILITY * self.weight[0] * (1 - 1e-9)
        ranked = sorted((n for n in range(1, len(self.weight)) if self.weight[n] >= floor
                         and self.depth[n] <= max_depth), key=self._rank)
        chosen = sorted(ranked[:budget])  # parents first
        place = {0: 0, **{n: i + 1 for i, n in enumerate(chosen)}}
        return TokenTree((self.token[0], *(self.token[n] for n in chosen)),
                         (-1, *(place[self.parent[n]] for n in chosen)))


@dataclass
class Lookup:
    """A sequence's matches at one length of it (in its own tokens, in the cache), and the trie of
    what followed them."""

    at: int  # the sequence's length
    version: int  # the cache's then
    depth: int  # the continuations' depth at most (besides the match's own bound)
    length: int  # the longer match's
    cached: Match | None  # the cache's match, if it joined the trie
    trie: Trie | None


@dataclass
class _Sequence(Guesses):
    """A sequence's tokens, searchable, its open guesses, and its latest lookup."""

    array: TokenArray = field(default_factory=TokenArray)
    lookup: Lookup | None = None


class SuffixDrafter(Drafter, Observes, Estimates):
    def __init__(self, cache_tokens: int = SUFFIX_CACHE_TOKENS):
        self.cache = OutputCache(cache_tokens)
        self.spec = "suffix" if cache_tokens == SUFFIX_CACHE_TOKENS else f"suffix:{cache_tokens}"
        self._sequences: dict[int, _Sequence] = {}
        self._scores = GuessScores((len(LENGTH_BOUNDS) + 1) * AGREEMENT)

    # -- the drafter ------------------------------------------------------------------------------

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [self._propose(r) for r in requests]

    def observe(self, commit: Commit) -> None:
        sequence = self._sequences.get(commit.seq_id)
        if sequence is not None:
            self._scores.resolve(sequence, commit.token_ids)

    def ended(self, ended: Ended) -> None:
        if ended.shared and ended.output_ids:
            self.cache.add(ended.seq_id, ended.output_ids)

    def release(self, seq_id: int) -> None:
        sequence = self._sequences.pop(seq_id, None)
        if sequence is not None:  # guesses still coming true count for the depths they reached
            for guess in sequence.guesses:
                self._scores.close(guess)

    def gauges(self) -> dict[str, float]:
        return {"suffix_cache_tokens": self.cache.tokens, "suffix_cache_outputs": len(self.cache),
                "suffix_cache_bytes": self.cache.nbytes,
                "suffix_sequence_bytes": sum(s.array.tokens.nbytes for s in list(self._sequences.values()))}

    # -- estimates --------------------------------------------------------------------------------

    def acceptance_profile(self, seq_id: int, token_ids: Sequence[int], max_depth: int) -> list[float]:
        guess = self._catch_up(seq_id, token_ids).latest
        if guess is None:
            return [0.0] * max_depth
        return self._scores.profile(guess.kind, max_depth)

    def acceptance_bound(self) -> float:
        return self._scores.best_first()

    # -- inside -----------------------------------------------------------------------------------

    def _catch_up(self, seq_id: int, tokens: Sequence[int]) -> _Sequence:
        """The sequence's array extended to `tokens` and its guess for what comes next, made once
        per length (and kept to be scored by the commits that follow), as n-gram lookup does."""
        sequence = self._sequences.get(seq_id)
        if sequence is None or sequence.array.size > len(tokens):  # new, or not this sequence's tokens
            sequence = self._sequences[seq_id] = _Sequence()
        if sequence.guessed_at != len(tokens):
            sequence.array.extend(tokens[sequence.array.size :])
            sequence.made(len(tokens), self._guess(self._lookup(sequence, tokens)))
        return sequence

    def _lookup(self, sequence: _Sequence, tokens: Sequence[int], depth: int = GUESS_DEPTH) -> Lookup:
        """The longest matches of the sequence's end in its own tokens and in the cache, and what
        followed them, `depth` tokens at most (what a guess or a draft reads of them: a long
        match's continuations would run up to 66 tokens deep, most of a lookup's trie): each
        source's continuations as one distribution, the two mixed in proportion to their match
        lengths (a longer match is the likelier to go on alike; a source that matched a tenth as
        long as the other adds nothing the floor keeps). Looked up once per length of the
        sequence and state of the cache (again for a deeper draft)."""
        found = sequence.lookup
        if found is not None and (found.at, found.version) == (len(tokens), self.cache.version) \
                and found.depth >= depth:
            return found
        query = tokens[-MAX_MATCH - 1 :]
        own = longest_match(sequence.array.tokens, query)
        cached = self.cache.match(query) if len(self.cache) else None
        matches = [m for m in (own, cached) if m is not None]
        rows: list[list[int]] = []
        weights: list[float] = []
        for match in matches:
            continuations = match.continuations(min(depth, DEPTH_PER_MATCHED * match.length + DEPTH_BEYOND_MATCH))
            share = match.length / sum(m.length for m in matches) / len(continuations)
            rows += continuations
            weights += [share] * len(continuations)
        trie = Trie(tokens[-1], rows, weights) if rows else None
        length = max((m.length for m in matches), default=0)
        sequence.lookup = Lookup(len(tokens), self.cache.version, depth, length, cached, trie)
        return sequence.lookup

    def _guess(self, lookup: Lookup) -> Guess | None:
        """The match's most followed continuation, by kind of match (None: no match)."""
        if lookup.trie is None:
            return None
        spine = lookup.trie.spine()[:GUESS_DEPTH]
        if not spine:
            return None
        firsts = len(lookup.trie.children[0])
        agreement = 0 if lookup.trie.rows == 1 else (1 if firsts == 1 else 2)
        kind = bisect.bisect_left(LENGTH_BOUNDS, lookup.length) * AGREEMENT + agreement
        return Guess(kind, lookup.at, spine)

    def _propose(self, request: DraftRequest) -> Draft:
        tokens = request.token_ids
        lookup = self._lookup(self._catch_up(request.seq_id, tokens), tokens, max(GUESS_DEPTH, request.max_depth))
        if lookup.trie is None or request.tree_budget <= 0 or request.max_depth <= 0:
            return Draft(TokenTree.single(tokens[-1]))
        if lookup.cached is not None:
            self.cache.used(lookup.cached.after[-MAX_OCCURRENCES:])
        return Draft(lookup.trie.tree(request.tree_budget, request.max_depth))
