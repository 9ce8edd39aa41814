"""Prompt lookup: propose what followed earlier occurrences of the sequence's last n tokens.

No weights. Generated text often repeats its prompt or itself (code, quotes, lists, names),
and wherever it does, the continuation after the last match is a good guess. Matches are
looked up longest n-gram first in an index kept per sequence and extended incrementally,
so a step costs O(new tokens), not O(sequence). The most recent matches come first; several
distinct continuations become a tree (shared prefixes merged).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from drafters.base import Draft, Drafter, DraftRequest
from specserve.tree import TokenTree


@dataclass
class _Index:
    """For each n, n-gram -> positions right after its occurrences (oldest first)."""

    ngrams: dict[int, dict[tuple[int, ...], list[int]]] = field(default_factory=dict)
    indexed: int = 0  # continuations starting before this position are indexed

    def extend(self, tokens: Sequence[int], sizes: range) -> None:
        # Index continuation starts up to len - 1: the n-gram ending at the last token is the
        # query itself and must not match itself.
        for start in range(max(self.indexed, sizes.start), len(tokens)):
            for n in sizes:
                if start >= n:
                    key = tuple(tokens[start - n : start])
                    self.ngrams.setdefault(n, {}).setdefault(key, []).append(start)
        self.indexed = max(self.indexed, len(tokens))


class NgramDrafter(Drafter):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes need 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.sizes = range(min_ngram, max_ngram + 1)
        self.max_matches = max_matches
        self.spec = "ngram"
        self._indexes: dict[int, _Index] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [self._propose(r) for r in requests]

    def release(self, seq_id: int) -> None:
        self._indexes.pop(seq_id, None)

    def _propose(self, request: DraftRequest) -> Draft:
        tokens = request.token_ids
        index = self._indexes.setdefault(request.seq_id, _Index())
        index.extend(tokens, self.sizes)
        paths = self._continuations(tokens, index, request.max_depth)
        if len(paths) > 1:
            # The best match runs deepest, but not so deep that no alternative gets a node: at
            # least half the budget for it, the rest for the other matches' first tokens onwards.
            budget = request.max_nodes
            paths[0] = paths[0][: max(-(-budget // 2), budget - (len(paths) - 1))]
        return Draft(TokenTree.from_paths(tokens[-1], paths, max_nodes=request.max_nodes))

    def _continuations(self, tokens: Sequence[int], index: _Index, depth: int) -> list[list[int]]:
        """Distinct continuations of the longest matching n-grams, most recent match first."""
        if depth <= 0:
            return []
        paths: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in reversed(self.sizes):
            if len(tokens) < n:
                continue
            for start in reversed(index.ngrams.get(n, {}).get(tuple(tokens[-n:]), [])):
                path = tuple(tokens[start : start + depth])
                if path and path not in seen:
                    seen.add(path)
                    paths.append(list(path))
                    if len(paths) >= self.max_matches:
                        return paths
        return paths
