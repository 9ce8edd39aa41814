"""Several drafters' trees merged into one (SpecInfer), the budget shared by measured worth.

Every part proposes within the whole budget, and what each proposal was worth is measured after
the step, whichever paths made the merged tree: the tokens its best path would have had accepted
(its longest agreement with what the target committed). A moving average of that, per sequence,
splits the next step's budget between the parts: the most trusted part's paths first, each part
cut to its share, then what shares left unused filled with the rest of their paths in the same
order. A new sequence starts from the parts' worth over all sequences so far.
"""

from __future__ import annotations

from collections.abc import Sequence

from drafters.base import Commit, Draft, Drafter, DraftRequest, Ended, Estimates, Observes
from specserve.tree import TokenTree

SEQUENCE_RATE = 0.3  # weight of the latest step in a sequence's average: a few steps to follow a change
OVERALL_RATE = 0.02  # the same over all sequences (a new sequence's starting point)
PRIOR_WORTH = 1.0  # before anything is measured: an equal split


class MergedDrafter(Drafter, Observes, Estimates):
    """Merged children are verified as deterministic proposals, which is lossless whatever
    their origin (a sampled drafter's distribution no longer describes a merged sibling set)."""

    def __init__(self, drafters: Sequence[Drafter]):
        if len(drafters) < 2:
            raise ValueError("a merge needs at least two drafters")
        self.drafters = list(drafters)
        self.spec = "+".join(d.spec for d in drafters)
        self.overall = [PRIOR_WORTH] * len(self.drafters)
        self._worth: dict[int, list[float]] = {}  # seq_id -> each part's worth for that sequence
        # seq_id -> (tokens before the step, each part's proposed paths): scored when the step commits
        self._proposed: dict[int, tuple[int, list[list[list[int]]]]] = {}

    def worth(self, seq_id: int) -> list[float]:
        """Each part's average accepted tokens per step for the sequence (the overall one before any)."""
        return list(self._worth.get(seq_id, self.overall))

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        proposals = [d.propose(requests) for d in self.drafters]
        merged = []
        for i, request in enumerate(requests):
            paths = [tree_paths(p[i].tree) for p in proposals]
            self._proposed[request.seq_id] = (len(request.token_ids), paths)
            merged.append(Draft(self._merge(request, paths)))
        return merged

    def _merge(self, request: DraftRequest, paths: list[list[list[int]]]) -> TokenTree:
        root, worth = request.token_ids[-1], self.worth(request.seq_id)
        order = sorted(range(len(paths)), key=lambda p: -worth[p])  # stable: ties keep spec order
        shares = budget_shares(request.tree_budget, worth)
        within = [q for p in order for q in tree_paths(TokenTree.from_paths(root, paths[p], shares[p]))]
        rest = [q for p in order for q in paths[p]]
        return TokenTree.from_paths(root, within + rest, tree_budget=request.tree_budget)

    def observe(self, commit: Commit) -> None:
        for drafter in self.drafters:
            if isinstance(drafter, Observes):
                drafter.observe(commit)
        proposed = self._proposed.pop(commit.seq_id, None)
        if proposed is None:  # a step it drafted nothing for (a prompt chunk)
            return
        before, paths = proposed
        committed = commit.token_ids[before:]
        worth = self._worth.setdefault(commit.seq_id, list(self.overall))
        for p, part_paths in enumerate(paths):
            accepted = max((agreement(path, committed) for path in part_paths), default=0)
            worth[p] += SEQUENCE_RATE * (accepted - worth[p])
            self.overall[p] += OVERALL_RATE * (accepted - self.overall[p])

    def release(self, seq_id: int) -> None:
        self._worth.pop(seq_id, None)
        self._proposed.pop(seq_id, None)
        for drafter in self.drafters:
            drafter.release(seq_id)

    def hidden_wanted(self) -> tuple[int, ...]:
        return tuple(sorted({k for d in self.drafters if isinstance(d, Observes) for k in d.hidden_wanted()}))

    def ended(self, ended: Ended) -> None:
        for drafter in self.drafters:
            if isinstance(drafter, Observes):
                drafter.ended(ended)

    def acceptance_profile(self, seq_id: int, token_ids: Sequence[int], max_depth: int) -> list[float] | None:
        """At least what its surest part's guess is worth (that part's paths lead the merged tree);
        None where a part has no estimate (the policy then goes by measured acceptance)."""
        profiles = [d.acceptance_profile(seq_id, token_ids, max_depth) if isinstance(d, Estimates) else None
                    for d in self.drafters]
        if any(p is None for p in profiles):
            return None
        return [max(values) for values in zip(*profiles, strict=True)]

    def acceptance_bound(self) -> float | None:
        bounds = [d.acceptance_bound() if isinstance(d, Estimates) else None for d in self.drafters]
        return None if None in bounds else max(bounds)

    def step_cost(self, tree_budget: int) -> float:
        return sum(d.step_cost(tree_budget) for d in self.drafters if isinstance(d, Estimates))


def budget_shares(budget: int, worth: Sequence[float]) -> list[int]:
    """`budget` nodes split in proportion to `worth` (largest remainders round up; all equal
    where nothing is worth anything)."""
    total = sum(max(0.0, w) for w in worth)
    weights = [max(0.0, w) / total for w in worth] if total > 0 else [1 / len(worth)] * len(worth)
    exact = [budget * w for w in weights]
    shares = [int(e) for e in exact]
    by_remainder = sorted(range(len(worth)), key=lambda p: shares[p] - exact[p])
    for p in by_remainder[: budget - sum(shares)]:
        shares[p] += 1
    return shares


def agreement(path: Sequence[int], committed: Sequence[int]) -> int:
    """How many of `path`'s tokens the target would have accepted: its common prefix with `committed`."""
    n = 0
    for drafted, kept in zip(path, committed, strict=False):
        if drafted != kept:
            break
        n += 1
    return n


def tree_paths(tree: TokenTree) -> list[list[int]]:
    """The drafted tokens of every root-to-leaf path, in node order of the leaves."""
    return [tree.path_tokens(leaf)[1:] for leaf in tree.leaves if leaf != 0]
