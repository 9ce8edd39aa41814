"""Several drafters' trees merged into one (SpecInfer), the budget shared by measured worth.

Every part proposes within the whole budget, and what each proposal was worth is measured after
the step, whichever paths made the merged tree: the tokens its best path would have had accepted
(its longest agreement with what the target committed). A moving average of that, per sequence,
splits the next step's budget between the parts: the most trusted part's paths first, each part
cut to its share, then what shares left unused filled with the rest of their paths in the same
order. A new sequence starts from the parts' worth over all sequences so far.

A part that costs time to ask (a head, a draft model: `Estimates.step_cost`) is asked only where
what it adds is worth that time: its margin, the tokens the merged tree would have accepted
beyond what the other parts' paths alone would have (measured whenever it is asked), at the
step's going rate (`DraftRequest.token_seconds`). Otherwise it is explored: asked on one drafted
step in EXPLORE_EVERY (any sequence's, planned without it), so its margin is measured anew; an
exploration whose tokens beyond the other parts' did not pay for it doubles that interval (up to
MAX_EXPLORE_EVERY), one whose tokens did keeps it, and one after which the margin pays resets it.
A part that costs time starts at no margin: it earns its place by exploration. (A SmolLM2
feature head asked on every 16th step of each sequence, and at first everywhere, cost n-gram
lookup beside it 8% of its speed on a CPU, where the head never paid.) Free parts (n-gram and
suffix lookup) are always asked.
"""

from __future__ import annotations

from collections.abc import Sequence

from drafters.base import Commit, Draft, Drafter, DraftRequest, Ended, Estimates, Observes
from specserve.tree import TokenTree

SEQUENCE_RATE = 0.3  # weight of the latest step in a sequence's average: a few steps to follow a change
OVERALL_RATE = 0.02  # the same over all sequences (a new sequence's starting point)
PRIOR_WORTH = 1.0  # before anything is measured: an equal split
PRIOR_MARGIN = 0.0  # ... and a part that costs time has to show what it adds (explored) before it is asked
EXPLORE_EVERY = 16  # a part not worth its time is still asked on one drafted step in this many at first
MAX_EXPLORE_EVERY = 1024  # ... and in this many after explorations kept finding it not worth it


class MergedDrafter(Drafter, Observes, Estimates):
    """Merged children are verified as deterministic proposals, which is lossless whatever
    their origin (a sampled drafter's distribution no longer describes a merged sibling set)."""

    def __init__(self, drafters: Sequence[Drafter]):
        if len(drafters) < 2:
            raise ValueError("a merge needs at least two drafters")
        self.drafters = list(drafters)
        self.spec = "+".join(d.spec for d in drafters)
        self.overall = [PRIOR_WORTH] * len(self.drafters)
        self.overall_margin = [PRIOR_MARGIN] * len(self.drafters)
        self._worth: dict[int, list[float]] = {}  # seq_id -> each part's worth for that sequence
        self._margin: dict[int, list[float]] = {}  # seq_id -> each part's margin for that sequence
        self._unasked = [0] * len(self.drafters)  # drafted steps since each part was asked
        self._explore_every = [EXPLORE_EVERY] * len(self.drafters)
        self._token_seconds: float | None = None  # the going rate of the last step drafted
        # seq_id -> (tokens before the step, each part's proposed paths (None where not asked),
        # the parts asked only to explore them, the tree budget): scored when the step commits
        self._proposed: dict[int, tuple[int, list[list[list[int]] | None], list[int], int]] = {}

    def worth(self, seq_id: int) -> list[float]:
        """Each part's average accepted tokens per step for the sequence (the overall one before any)."""
        return list(self._worth.get(seq_id, self.overall))

    def margin(self, seq_id: int) -> list[float]:
        """Each part's average tokens accepted beyond the other parts' for the sequence."""
        return list(self._margin.get(seq_id, self.overall_margin))

    def asked(self, request: DraftRequest) -> tuple[list[bool], list[int]]:
        """Which parts a step of the sequence asks (see the module's docstring), at least one, and
        which of them only to explore them. Without a going rate (a fixed policy), all of them. The
        parts worth asking are those the policy planned the step by (`acceptance_profile`, at the
        rate it last saw)."""
        if request.token_seconds is None:
            return [True] * len(self.drafters), []
        worth = self._worth_asking(request.seq_id, self._token_seconds or 0.0, request.tree_budget)
        asked = [w or self._unasked[p] + 1 >= self._explore_every[p] for p, w in enumerate(worth)]
        return asked, [p for p, (a, w) in enumerate(zip(asked, worth, strict=True)) if a and not w]

    def _worth_asking(self, seq_id: int, token_seconds: float, tree_budget: int) -> list[bool]:
        """The parts whose margin for the sequence pays for their time; at least one."""
        costs, margin = self._costs(tree_budget), self.margin(seq_id)
        worth = _paying(costs, margin, token_seconds)
        if not any(worth):
            worth[max(range(len(costs)), key=lambda p: margin[p] * token_seconds - costs[p])] = True
        return worth

    def _costs(self, tree_budget: int) -> list[float]:
        return [d.step_cost(tree_budget) if isinstance(d, Estimates) else 0.0 for d in self.drafters]

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        asked, explored = zip(*(self.asked(r) for r in requests), strict=True) if requests else ((), ())
        self._token_seconds = next((r.token_seconds for r in requests if r.token_seconds is not None),
                                   self._token_seconds)
        for p in range(len(self.drafters)):
            self._unasked[p] = 0 if any(a[p] for a in asked) else self._unasked[p] + 1
        paths: list[list[list[list[int]] | None]] = [[None] * len(self.drafters) for _ in requests]
        for p, drafter in enumerate(self.drafters):
            mine = [i for i, a in enumerate(asked) if a[p]]
            if mine:
                for i, draft in zip(mine, drafter.propose([requests[i] for i in mine]), strict=True):
                    paths[i][p] = tree_paths(draft.tree)
        merged = []
        for request, request_paths, request_explored in zip(requests, paths, explored, strict=True):
            self._proposed[request.seq_id] = (len(request.token_ids), request_paths, request_explored,
                                              request.tree_budget)
            merged.append(Draft(self._merge(request, request_paths)))
        return merged

    def _merge(self, request: DraftRequest, paths: list[list[list[int]] | None]) -> TokenTree:
        root, worth = request.token_ids[-1], self.worth(request.seq_id)
        parts = [p for p in range(len(paths)) if paths[p] is not None]
        order = sorted(parts, key=lambda p: -worth[p])  # stable: ties keep spec order
        shares = dict(zip(parts, budget_shares(request.tree_budget, [worth[p] for p in parts]), strict=True))
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
        before, paths, explored, tree_budget = proposed
        committed = commit.token_ids[before:]
        accepted = {p: max((agreement(path, committed) for path in part_paths), default=0)
                    for p, part_paths in enumerate(paths) if part_paths is not None}
        worth = self._worth.setdefault(commit.seq_id, list(self.overall))
        margin = self._margin.setdefault(commit.seq_id, list(self.overall_margin))
        best = max(accepted.values())
        costs = self._costs(tree_budget)
        for p, tokens in accepted.items():
            beyond = best - max((a for q, a in accepted.items() if q != p), default=0)
            worth[p] += SEQUENCE_RATE * (tokens - worth[p])
            margin[p] += SEQUENCE_RATE * (beyond - margin[p])
            self.overall[p] += OVERALL_RATE * (tokens - self.overall[p])
            self.overall_margin[p] += OVERALL_RATE * (beyond - self.overall_margin[p])
            if p in explored and self._token_seconds is not None:
                self._explore_every[p] = self._next_exploration(p, beyond, margin[p], costs[p])

    def _next_exploration(self, part: int, beyond: float, margin: float, cost: float) -> int:
        """The part's exploration interval after an exploration that found it adding `beyond`
        tokens: back to the first if its margin now pays for it; kept if this time's tokens did
        (a margin grows over a few explorations); else doubled."""
        if cost <= margin * self._token_seconds:
            return EXPLORE_EVERY
        if cost <= beyond * self._token_seconds:
            return self._explore_every[part]
        return min(2 * self._explore_every[part], MAX_EXPLORE_EVERY)

    def release(self, seq_id: int) -> None:
        for table in (self._worth, self._margin, self._proposed):
            table.pop(seq_id, None)
        for drafter in self.drafters:
            drafter.release(seq_id)

    def hidden_wanted(self) -> tuple[int, ...]:
        return tuple(sorted({k for d in self.drafters if isinstance(d, Observes) for k in d.hidden_wanted()}))

    def ended(self, ended: Ended) -> None:
        for drafter in self.drafters:
            if isinstance(drafter, Observes):
                drafter.ended(ended)

    def acceptance_profile(self, seq_id: int, token_ids: Sequence[int], max_depth: int) -> list[float]:
        """At least what its surest part's guess is worth (that part's paths lead the merged tree),
        over the parts worth asking (no rate seen yet: the free ones; a part due to be explored is
        asked on a step planned without it). A part with no estimate of its own is taken at its
        measured worth for the sequence: accepted runs of that mean, geometric."""
        worth_asking = self._worth_asking(seq_id, self._token_seconds or 0.0, max_depth)
        profiles = []
        for drafter, asked, worth in zip(self.drafters, worth_asking, self.worth(seq_id), strict=True):
            if not asked:
                continue
            profile = drafter.acceptance_profile(seq_id, token_ids, max_depth) if isinstance(drafter, Estimates) \
                else None
            if profile is None:  # runs of mean `worth` accepted tokens: alpha / (1 - alpha) = worth
                alpha = max(0.0, worth) / (1 + max(0.0, worth))
                profile = [alpha ** k for k in range(1, max_depth + 1)]
            profiles.append(profile)
        return [max(values) for values in zip(*profiles, strict=True)]

    def acceptance_bound(self) -> float | None:
        """Over the parts asked by default: free ones and those worth their time over all sequences."""
        bounds = [d.acceptance_bound() if isinstance(d, Estimates) else None
                  for d, trusted in zip(self.drafters, self._trusted(), strict=True) if trusted]
        return None if None in bounds else max(bounds)

    def _trusted(self, tree_budget: int = 1) -> list[bool]:
        """Parts a step asks without exploring them, over all sequences (no going rate seen yet:
        the free ones)."""
        return _paying(self._costs(tree_budget), self.overall_margin, self._token_seconds or 0.0)

    def step_cost(self, tree_budget: int) -> float:
        """The parts worth their time over all sequences, and a share of the others' (explored)."""
        costs = self._costs(tree_budget)
        return sum(cost if trusted else cost / self._explore_every[p]
                   for p, (cost, trusted) in enumerate(zip(costs, self._trusted(tree_budget), strict=True)))


def _paying(costs: Sequence[float], margins: Sequence[float], token_seconds: float) -> list[bool]:
    """Whether each part's margin (tokens a step) is worth its cost (seconds a step) at the rate."""
    return [cost <= margin * token_seconds for cost, margin in zip(costs, margins, strict=True)]


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
