"""Per-step tree budgets: speculate where it pays, and by as much as it pays.

For the decoding sequences of a step, the adaptive policy picks b_r drafted nodes each to
maximise the step's expected emitted tokens per second:

    rate(b) = sum_r (1 + E_r(b_r)) / (T(N0 + sum_r b_r) + sum_d D_d(b))

* E_r(b) = alpha_r + alpha_r^2 + ... + alpha_r^b: expected accepted tokens if each next
  drafted token is accepted with probability alpha_r, the sequence's measured acceptance
  (shrunk toward its drafter's while the sequence has few steps of its own);
* T: the calibrated cost of a target forward of N tokens (`specserve.cost_model`), N0 the
  step's tokens without trees (decodes and prompt chunks), times a correction learned from
  measured steps, kept apart for steps with and without trees and by batch size: a batch with
  trees loses the decode-only fast paths and pays for verification, which a single-chain
  calibration cannot see;
* D_d: drafter d's own estimate of a step's drafting time for the largest tree it grows
  (`Drafter.step_cost`, from its measured draft forwards; 0 for n-gram lookup).

Nodes are added one at a time where the marginal gain alpha_r^(b_r+1) is largest, and the
best prefix of that order wins, b = 0 included: at high load, where every extra row costs
real time, nothing is speculated and the engine runs as fast as without speculation.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass

from drafters.base import Drafter
from specserve.cost_model import ForwardCost, RecentMedian
from specserve.sequence import Sequence

PRIOR_STEPS = 4  # a new sequence's acceptance counts its drafter's as this many steps of its own
# Optimism in the face of uncertainty (UCB): while a drafter has few verified steps its
# sequences are credited alpha + EXPLORE / sqrt(1 + steps), so a drafter judged on a few
# unlucky steps is not switched off for good (per drafter, not per sequence: exploring every
# new sequence would cost a busy server on every request).
EXPLORE = 0.3
MIN_GAIN = 1e-3  # expected tokens below which another node is not worth considering


@dataclass
class _DrafterRecord:
    accepted: int = 0
    rejected: int = 0  # verify steps (each ends in a rejection or the budget's end)


class SpeculationPolicy:
    """Fixed: every speculating sequence gets its cap. Adaptive: the budgets that maximise rate."""

    def __init__(self, adaptive: bool, forward_cost: ForwardCost | None = None):
        self.adaptive = adaptive
        self.forward_cost = forward_cost
        self._drafters: dict[int, _DrafterRecord] = {}
        self._scales: dict[tuple[bool, int], RecentMedian] = {}  # (with trees, batch bucket) -> measured / calibrated
        # Seconds per emitted token of the last plan chosen: what a token is worth to a drafter
        # deciding whether another draft forward pays (None when not adaptive).
        self.token_seconds: float | None = None

    # -- measurements -------------------------------------------------------------------------

    def observe_verify(self, drafter: Drafter, accepted: int) -> None:
        record = self._record(drafter)
        record.accepted += accepted
        record.rejected += 1

    def observe_step(self, num_seqs: int, num_tokens: int, with_trees: bool, seconds: float) -> None:
        """A step's measured time from its forward to its last emitted token (drafting excluded)."""
        if self.forward_cost is None:
            return
        key = (with_trees, num_seqs.bit_length())
        self._scales.setdefault(key, RecentMedian()).add(seconds / self.forward_cost(num_tokens))

    def step_seconds(self, num_seqs: int, num_tokens: int, with_trees: bool) -> float:
        """Predicted time of a step (without drafting); with trees, unmeasured, it is assumed to
        cost what a plain step of as many tokens costs (optimism: it then gets measured)."""
        scale = self._scale(False, num_seqs) or 1.0
        if with_trees:
            scale = self._scale(True, num_seqs) or scale
        return scale * self.forward_cost(num_tokens)

    def _scale(self, with_trees: bool, num_seqs: int) -> float | None:
        measured = self._scales.get((with_trees, num_seqs.bit_length()))
        return None if measured is None else measured.value

    def acceptance(self, seq: Sequence) -> float:
        """alpha: the probability that the next drafted token is accepted, for this sequence."""
        record = self._record(seq.drafter)
        prior = (record.accepted + 1) / (record.accepted + record.rejected + 2)
        stats = seq.spec
        return (stats.accepted_tokens + PRIOR_STEPS * prior) / (stats.accepted_tokens + stats.verify_steps
                                                                + PRIOR_STEPS)

    # -- the decision ---------------------------------------------------------------------------

    def budgets(self, caps: Mapping[Sequence, int], base_tokens: int, max_total: int,
                num_seqs: int | None = None) -> dict[Sequence, int]:
        """Drafted nodes per sequence (each within its cap, all within `max_total`). `num_seqs`:
        the step's decoding sequences, speculating or not (default: those in `caps`)."""
        if not self.adaptive or self.forward_cost is None:
            chosen, left = {}, max_total
            for seq, cap in caps.items():
                chosen[seq] = min(cap, left)
                left -= chosen[seq]
            return chosen
        return self._best_budgets(caps, base_tokens, max_total, len(caps) if num_seqs is None else num_seqs)

    def _best_budgets(self, caps: Mapping[Sequence, int], base_tokens: int, max_total: int,
                      num_seqs: int) -> dict[Sequence, int]:
        alphas = {seq: min(0.99, self.acceptance(seq) + EXPLORE / math.sqrt(1 + self._record(seq.drafter).rejected))
                  for seq, cap in caps.items() if cap > 0}
        budgets = dict.fromkeys(caps, 0)
        deepest: dict[Drafter, int] = {}  # drafter -> largest budget so far
        tokens = float(num_seqs)  # every decoding sequence emits at least one token
        total = 0
        draft_seconds = 0.0
        plain_seconds = self.step_seconds(num_seqs, base_tokens, with_trees=False)
        best_rate, best = tokens / plain_seconds, dict(budgets)
        heap = [(-alpha, seq.seq_id, seq) for seq, alpha in alphas.items()]
        heapq.heapify(heap)
        while heap and total < max_total:
            neg_gain, _, seq = heapq.heappop(heap)
            if -neg_gain < MIN_GAIN:
                break
            budgets[seq] += 1
            total += 1
            tokens += -neg_gain
            drafter = seq.drafter
            if budgets[seq] > deepest.get(drafter, 0):
                draft_seconds += drafter.step_cost(budgets[seq]) - drafter.step_cost(deepest.get(drafter, 0))
                deepest[drafter] = budgets[seq]
            rate = tokens / (self.step_seconds(num_seqs, base_tokens + total, with_trees=True) + draft_seconds)
            if rate > best_rate:
                best_rate, best = rate, dict(budgets)
            if budgets[seq] < caps[seq]:
                heapq.heappush(heap, (neg_gain * alphas[seq], seq.seq_id, seq))
        self.token_seconds = 1.0 / best_rate
        return best

    def _record(self, drafter: Drafter | None) -> _DrafterRecord:
        return self._drafters.setdefault(id(drafter), _DrafterRecord())
