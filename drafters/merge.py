"""Several drafters' trees merged into one (SpecInfer): shared prefixes are deduplicated."""

from __future__ import annotations

from collections.abc import Sequence

from drafters.base import Commit, Draft, Drafter, DraftRequest, Ended, Estimates, Observes
from specserve.tree import TokenTree


class MergedDrafter(Drafter, Observes, Estimates):
    """Each drafter proposes within the whole budget; root-to-leaf paths are then merged in
    drafter order (the first drafter's tree is kept whole) until the budget is spent.

    Merged children are verified as deterministic proposals, which is lossless whatever
    their origin (a sampled drafter's distribution no longer describes a merged sibling set).
    """

    def __init__(self, drafters: Sequence[Drafter]):
        if len(drafters) < 2:
            raise ValueError("a merge needs at least two drafters")
        self.drafters = list(drafters)
        self.spec = "+".join(d.spec for d in drafters)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        proposals = [d.propose(requests) for d in self.drafters]
        merged = []
        for i, request in enumerate(requests):
            paths = [tree_paths(p[i].tree) for p in proposals]
            tree = TokenTree.from_paths(request.token_ids[-1], [q for ps in paths for q in ps],
                                        tree_budget=request.tree_budget)
            merged.append(Draft(tree))
        return merged

    def release(self, seq_id: int) -> None:
        for drafter in self.drafters:
            drafter.release(seq_id)

    def hidden_wanted(self) -> tuple[int, ...]:
        return tuple(sorted({k for d in self.drafters if isinstance(d, Observes) for k in d.hidden_wanted()}))

    def observe(self, commit: Commit) -> None:
        for drafter in self.drafters:
            if isinstance(drafter, Observes):
                drafter.observe(commit)

    def ended(self, ended: Ended) -> None:
        for drafter in self.drafters:
            if isinstance(drafter, Observes):
                drafter.ended(ended)

    def step_cost(self, tree_budget: int) -> float:
        return sum(d.step_cost(tree_budget) for d in self.drafters if isinstance(d, Estimates))


def tree_paths(tree: TokenTree) -> list[list[int]]:
    """The drafted tokens of every root-to-leaf path, in node order of the leaves."""
    return [tree.path_tokens(leaf)[1:] for leaf in tree.leaves if leaf != 0]
