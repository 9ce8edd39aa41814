"""Replay drafting (`replay:ALPHA`): speculation at a set acceptance, for system benchmarks.

For a sequence whose continuation is known, because a run without speculation (or any earlier
run) produced it, each drafted token is that continuation's next token with probability ALPHA
and otherwise a wrong one. So the engine's whole speculative path (trees, verification, K/V
compaction, the policy) can be measured at an acceptance chosen in advance, on any weights,
random ones included (`--load-format dummy`). Its trees go through verification like any
drafter's: output is the target's alone.

Continuations are learned from what the engine commits (`observe`; each sequence's tokens are
kept when it ends) or given (`record`). A sequence with no known continuation gets no draft, so
the first run of a workload is a run without speculation, and repeats replay it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from drafters.base import Commit, Draft, Drafter, DraftRequest, DraftTarget, Estimates, Observes, UsesTarget
from specserve.tree import TokenTree

KEY_TOKENS = 16  # a recorded sequence is found by its first tokens (each prefix length up to this)
# Sequences kept, the oldest forgotten first: a server whose clients name `replay:` per request
# must not grow without bound (a benchmark's workload is far smaller).
MAX_RECORDED = 4096


class ReplayDrafter(Drafter, Observes, Estimates, UsesTarget):
    def __init__(self, alpha: float, seed: int = 0, width: int = 1):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"replay acceptance {alpha} must lie in [0, 1]")
        if width < 1:
            raise ValueError(f"replay tree width {width} must be at least 1")
        self.alpha, self.width = alpha, width
        self.spec = f"replay:{alpha:g}"
        self._random = random.Random(seed)
        self._book: dict[tuple[int, ...], list[tuple[int, ...]]] = {}  # first tokens -> recorded sequences
        self._recorded: dict[tuple[int, ...], None] = {}  # every recorded sequence, oldest first
        self._live: dict[int, list[int]] = {}  # seq_id -> its tokens as last committed
        self._following: dict[int, tuple[int, ...]] = {}  # seq_id -> the recorded sequence it matches
        self.vocab_size: int | None = None

    def attach(self, target: DraftTarget) -> None:
        self.vocab_size = target.vocab_size

    # -- what it knows --------------------------------------------------------------------------

    def record(self, token_ids: Sequence[int]) -> None:
        """A sequence the target produced (prompt + output): later sequences that begin like it follow it."""
        tokens = tuple(token_ids)
        if tokens in self._recorded:
            return
        self._recorded[tokens] = None
        for n in range(1, min(KEY_TOKENS, len(tokens)) + 1):
            self._book.setdefault(tokens[:n], []).append(tokens)
        if len(self._recorded) > MAX_RECORDED:
            self._forget(next(iter(self._recorded)))

    def _forget(self, tokens: tuple[int, ...]) -> None:
        del self._recorded[tokens]
        for n in range(1, min(KEY_TOKENS, len(tokens)) + 1):
            entries = self._book[tokens[:n]]
            entries.remove(tokens)
            if not entries:
                del self._book[tokens[:n]]

    def observe(self, commit: Commit) -> None:
        self._live[commit.seq_id] = list(commit.token_ids)

    def release(self, seq_id: int) -> None:
        tokens = self._live.pop(seq_id, None)
        self._following.pop(seq_id, None)
        if tokens is not None:
            self.record(tokens)

    def continuation(self, seq_id: int, token_ids: Sequence[int]) -> tuple[int, ...]:
        """What a recorded sequence that begins with `token_ids` went on with (empty: none known)."""
        recorded = self._following.get(seq_id)
        if recorded is None or not _extends(recorded, token_ids):
            candidates = self._book.get(tuple(token_ids[:KEY_TOKENS]), ())
            recorded = next((r for r in candidates if _extends(r, token_ids)), None)
            if recorded is None:
                self._following.pop(seq_id, None)
                return ()
            self._following[seq_id] = recorded
        return recorded[len(token_ids):]

    # -- proposing ------------------------------------------------------------------------------

    def acceptance_profile(self, seq_id: int, token_ids: Sequence[int], max_depth: int) -> Sequence[float]:
        known = len(self.continuation(seq_id, token_ids))
        return [self.alpha**k if k <= known else 0.0 for k in range(1, max_depth + 1)]

    def acceptance_bound(self) -> float:
        return self.alpha

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [Draft(self._tree(r)) for r in requests]

    def _tree(self, request: DraftRequest) -> TokenTree:
        """A spine along the continuation, each node its next token with probability alpha (else a
        wrong one); with width w > 1 each spine node has w - 1 siblings, shallowest first while the
        budget lasts, of which the first to come up with probability alpha holds the true token
        where the spine node missed it (siblings are leaves)."""
        truth = self.continuation(request.seq_id, request.token_ids)
        width = max(1, request.top_k or self.width)
        tokens, parents = [request.token_ids[-1]], [-1]
        parent, budget = 0, request.tree_budget
        for k in range(min(request.max_depth, len(truth))):
            if budget == 0:
                break
            found = self._random.random() < self.alpha
            level = [truth[k] if found else self._wrong({truth[k]})]
            for _ in range(min(width - 1, budget - 1)):
                hit = not found and self._random.random() < self.alpha
                found = found or hit
                level.append(truth[k] if hit else self._wrong({truth[k], *level}))
            tokens += level
            parents += [parent] * len(level)
            budget -= len(level)
            parent = len(tokens) - len(level)  # the spine node: the level's first
        return TokenTree(tuple(tokens), tuple(parents))

    def _wrong(self, taken: set[int]) -> int:
        """A token none of `taken` is."""
        vocab = self.vocab_size or max(taken) + len(taken) + 1
        while (token := self._random.randrange(vocab)) in taken:
            pass
        return token


def _extends(recorded: tuple[int, ...], token_ids: Sequence[int]) -> bool:
    """`recorded` begins with `token_ids` and goes on past them."""
    n = len(token_ids)
    return len(recorded) > n and recorded[n - 1] == token_ids[-1] and recorded[:n] == tuple(token_ids)
