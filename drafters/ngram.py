"""Prompt lookup: propose what followed earlier occurrences of the sequence's last n tokens.

No weights: the sequence's tokens, as bytes, searched with `bytes.rfind`, longest n-gram
first. A guess (the best match's continuation) is made where the speculation policy asks what it
is worth (`acceptance_profile`) or a draft is wanted, once per length of the sequence; commits
(`observe`) score the open guesses by kind of match. Not a guess at every commit: a busy server's
policy asks rarely, and a search per sequence per commit was most of what speculation cost it
in steps that drafted nothing. Why: docs/design.md.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice

from drafters.base import Commit, Draft, Drafter, DraftRequest, Estimates, Observes
from specserve.tree import TokenTree

GUESS_DEPTH = 16  # tokens of the best match's continuation kept score of
AGREEMENT = 3  # kinds of match by how many of the latest occurrences agree on the next token: 1, 2, 3+
RECENT = 4  # occurrences looked at for that agreement
PRIOR_RATE, PRIOR_WEIGHT = 0.5, 2.0  # an unscored kind of match: a coin flip, worth two guesses
MIN_TREE_BUDGET = 4  # below this, the best match's chain alone (see `_propose`)
TOKEN_TYPECODE, TOKEN_BYTES = "i", 4  # a token id as bytes, for `bytes.rfind`


@dataclass
class Guess:
    """The best match's continuation when the sequence had `at` tokens, scored once it resolves."""

    kind: int
    at: int
    tokens: list[int]
    matched: int = 0  # of its tokens came true so far


@dataclass
class Guesses:
    """A sequence's guesses not yet resolved (oldest first), and the latest one, made when it had
    `guessed_at` tokens (None: nothing matched then)."""

    guesses: list[Guess] = field(default_factory=list)
    guessed_at: int = -1
    latest: Guess | None = None

    def made(self, at: int, guess: Guess | None) -> None:
        self.guessed_at, self.latest = at, guess
        if guess is not None:
            self.guesses.append(guess)


@dataclass
class _Index(Guesses):
    """A sequence's tokens as bytes, for n-gram search, and its guesses."""

    text: bytearray = field(default_factory=bytearray)  # the first `indexed` tokens, TOKEN_BYTES each

    @property
    def indexed(self) -> int:
        return len(self.text) // TOKEN_BYTES

    def extend(self, tokens: Sequence[int]) -> None:
        self.text += array(TOKEN_TYPECODE, tokens[self.indexed :]).tobytes()

    def occurrences(self, n: int) -> Iterator[int]:
        """Where earlier occurrences of the last n tokens were followed, most recent first (the
        last n tokens themselves are the query, not a match)."""
        needle = bytes(self.text[-n * TOKEN_BYTES :])
        end = (self.indexed - 1) * TOKEN_BYTES  # a match ends before the last token
        while (found := self.text.rfind(needle, 0, end)) >= 0:
            if found % TOKEN_BYTES:  # straddles tokens: look again just before it
                end = found + len(needle) - 1
                continue
            yield found // TOKEN_BYTES + n
            end = found + len(needle) - TOKEN_BYTES  # earlier matches may overlap this one


class GuessScores:
    """Per kind of match and depth k: how often the guess's k-th token came true when its
    first k - 1 had (conditional rates, so a guess still running scores the depths it reached).

    Plain Python lists, not numpy: a busy step scores a few dozen guesses and reads as many
    profiles, each a handful of numbers, and numpy's per-call overhead (worse with the caches
    cold from the forward just before) made that a sizeable share of the step's bookkeeping."""

    def __init__(self, kinds: int):
        self.hits = [[0.0] * GUESS_DEPTH for _ in range(kinds)]
        self.trials = [[0.0] * GUESS_DEPTH for _ in range(kinds)]
        self._profiles: dict[int, list[float]] = {}  # by kind, until its scores change

    def score(self, guess: Guess, actual: Sequence[int]) -> bool:
        """Score the guess against `actual`, the tokens since it was made: True once resolved
        (a token missed, or all came true); else it waits for more (and resumes where it stopped)."""
        for want, got in zip(guess.tokens[guess.matched :], actual[guess.matched :], strict=False):
            if want != got:
                self._add(guess.kind, guess.matched, missed=True)
                return True
            guess.matched += 1
        if guess.matched == len(guess.tokens):
            self._add(guess.kind, guess.matched, missed=False)
            return True
        return False

    def resolve(self, sequence: Guesses, tokens: Sequence[int]) -> None:
        """Score a sequence's open guesses against its tokens now (a commit's), keeping those still open."""
        sequence.guesses = [g for g in sequence.guesses if not self.score(g, tokens[g.at :])]

    def close(self, guess: Guess) -> None:
        """The sequence ended with the guess still coming true: it counts for the depths it reached."""
        self._add(guess.kind, guess.matched, missed=False)

    def profile(self, kind: int, depth: int) -> list[float]:
        """P(the guess's first k tokens all come true), k = 1..depth (the deepest rate repeats)."""
        row = self._cumulative(kind)
        if depth <= GUESS_DEPTH:
            return row[:depth]
        last = row[-1] / row[-2]
        return row + [row[-1] * last**k for k in range(1, depth - GUESS_DEPTH + 1)]

    def best_first(self) -> float:
        """The first token's rate of the surest kind of match."""
        return max(self._cumulative(kind)[0] for kind in range(len(self.hits)))

    def _cumulative(self, kind: int) -> list[float]:
        profile = self._profiles.get(kind)
        if profile is None:
            profile, running = [], 1.0
            for hits, trials in zip(self.hits[kind], self.trials[kind], strict=True):
                running *= (hits + PRIOR_RATE * PRIOR_WEIGHT) / (trials + PRIOR_WEIGHT)
                profile.append(running)
            self._profiles[kind] = profile
        return profile

    def _add(self, kind: int, matched: int, missed: bool) -> None:
        hits, trials = self.hits[kind], self.trials[kind]
        for k in range(matched):
            hits[k] += 1
            trials[k] += 1
        if missed:  # the token after the matched ones was tried and missed (a guess misses before its end)
            trials[matched] += 1
        self._profiles.pop(kind, None)


class NgramDrafter(Drafter, Observes, Estimates):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes need 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.sizes = range(min_ngram, max_ngram + 1)
        self.max_matches = max_matches
        self.spec = "ngram"
        self._indexes: dict[int, _Index] = {}
        self._scores = GuessScores(len(self.sizes) * AGREEMENT)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [self._propose(r) for r in requests]

    def observe(self, commit: Commit) -> None:
        index = self._indexes.get(commit.seq_id)
        if index is not None:
            self._scores.resolve(index, commit.token_ids)

    def acceptance_profile(self, seq_id: int, token_ids: Sequence[int], max_depth: int) -> list[float]:
        guess = self._catch_up(seq_id, token_ids).latest
        if guess is None:
            return [0.0] * max_depth
        return self._scores.profile(guess.kind, max_depth)

    def acceptance_bound(self) -> float:
        return self._scores.best_first()

    def release(self, seq_id: int) -> None:
        index = self._indexes.pop(seq_id, None)
        if index is not None:  # guesses still running count for the depths they reached
            for guess in index.guesses:
                self._scores.close(guess)

    def _catch_up(self, seq_id: int, tokens: Sequence[int]) -> _Index:
        """The sequence's index extended to `tokens` and its guess for what comes next, made once
        per length (and kept to be scored by the commits that follow)."""
        index = self._indexes.get(seq_id)
        if index is None or index.indexed > len(tokens):  # new, or not this sequence's tokens
            index = self._indexes[seq_id] = _Index()
        if index.guessed_at != len(tokens):
            index.extend(tokens)
            index.made(len(tokens), self._guess(index, tokens))
        return index

    def _guess(self, index: _Index, tokens: Sequence[int]) -> Guess | None:
        """The best match's continuation, by kind of match (None: no match)."""
        match = self._best_match(index)
        if match is None:
            return None
        n, starts = match
        recent = list(islice(starts, RECENT))
        agreeing = sum(tokens[s] == tokens[recent[0]] for s in recent)
        kind = (n - self.sizes.start) * AGREEMENT + min(agreeing, AGREEMENT) - 1
        return Guess(kind, len(tokens), list(tokens[recent[0] : recent[0] + GUESS_DEPTH]))

    def _matches(self, index: _Index) -> Iterator[tuple[int, Iterator[int]]]:
        """Every n-gram ending the sequence that occurred before, longest first: (n, where each
        occurrence was followed, most recent first)."""
        for n in reversed(self.sizes):
            if index.indexed > n:
                starts = index.occurrences(n)
                latest = next(starts, None)
                if latest is not None:
                    yield n, chain([latest], starts)

    def _best_match(self, index: _Index) -> tuple[int, Iterator[int]] | None:
        return next(self._matches(index), None)

    def _propose(self, request: DraftRequest) -> Draft:
        tokens = request.token_ids
        index = self._catch_up(request.seq_id, tokens)
        paths = self._continuations(tokens, index, request.max_depth)
        budget = request.tree_budget
        if len(paths) > 1 and budget < MIN_TREE_BUDGET and request.temperature == 0:
            # A small budget is a busy step's, priced by the policy as the best match's chain:
            # under greedy verification its next tokens are worth more than other matches' first
            # ones (a 3-token match's second token came true 80% of the times its first did).
            # Sampled verification keeps the siblings: a rejected token's sibling gets a second
            # draw (recursive rejection), which is where trees beat chains.
            paths = paths[:1]
        elif len(paths) > 1:
            # The best match runs deepest, but not so deep that no alternative gets a node: at
            # least half the budget for it, the rest for the other matches' first tokens onwards.
            paths[0] = paths[0][: max(-(-budget // 2), budget - (len(paths) - 1))]
        return Draft(TokenTree.from_paths(tokens[-1], paths, tree_budget=budget))

    def _continuations(self, tokens: Sequence[int], index: _Index, depth: int) -> list[list[int]]:
        """Distinct continuations of the longest matching n-grams, most recent match first."""
        if depth <= 0:
            return []
        paths: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for _, starts in self._matches(index):
            for start in starts:
                path = tuple(tokens[start : start + depth])
                if path and path not in seen:
                    seen.add(path)
                    paths.append(list(path))
                    if len(paths) >= self.max_matches:
                        return paths
        return paths
