"""Per-step tree budgets: speculate where it pays, and by as much as it pays.

`FixedPolicy` gives every speculating decode its cap; `AdaptivePolicy` picks the budgets that
maximise the step's expected tokens per second from each sequence's acceptance, the step's
fitted cost and the drafters' own costs. Both are asked by the scheduler (`plan`) and learn
only from the engine's `StepRecord`s (`observe`). The model and its reasons: docs/design.md.
"""

from __future__ import annotations

import math
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from drafters.base import Drafter, Estimates
from specserve.cost_model import ForwardCost, StepCost
from specserve.sequence import Sequence

PRIOR_STEPS = 4  # a new sequence's acceptance counts its drafter's as this many steps of its own
# Optimism in the face of uncertainty (UCB1): a drafter's sequences are credited alpha +
# EXPLORE * sqrt(max(1, ln looks) / (1 + steps)), `looks` the steps the policy weighed it,
# `steps` those it verified. A drafter judged on a few unlucky steps (a draft model's first
# guess after a prompt often differs from the target's in style alone) is not switched off for
# good: while it is not tried its credit grows, and it is tried again, ever more rarely if it
# keeps failing. Per drafter, not per sequence: exploring every new sequence would cost a busy
# server on every request.
EXPLORE = 0.3
MIN_GAIN = 1e-3  # expected tokens below which another node is not worth considering
# Trees only where the best plan promises at least this much more than plain steps. Below it the
# promise is within what the step-cost fit cannot tell apart at a busy server (steps of one batch
# size differ by their prompt chunks far more than by a few nodes), and a busy server's trees
# mostly promised fractions of a percent and lost more to the deciding and verifying around them.
MIN_RATE_GAIN = 0.02
# Looking at every sequence's guess takes a busy server's policy about a millisecond (32 n-gram
# searches, 1% of its step): after a look found no plan worth its trees, or the quick bound check
# found no node worth its price, the next steps at that batch size decide nothing until deciding
# has cost at most this share of the steps' time on average. At 32 clients, where trees about
# break even, 0.5% of the steps spent looking was most of the loss. A look at one sequence is never skipped:
# it is one guess (n-gram and suffix lookup make theirs where asked: suffix lookup over a full
# cache, about 1% of a batch-1 step), and a skipped step at batch 1 is a whole step without
# speculation (skipping after every failed look cost the repetitive workload a quarter of its
# accepted tokens). Unless its drafter guesses nothing of its own (a model or a head: judged by
# measured acceptance, which no step without a tree changes): then the next look would decide the
# same, and a SmolLM2 feature head's looks were 5% of its batch-1 steps.
DECIDING_SHARE = 0.002


@dataclass(frozen=True)
class StepShape:
    """What a step's cost depends on besides its drafted nodes, in the terms the scheduler plans
    with and the engine records: its decoding sequences, its tokens (decodes and prompt chunks),
    and the key positions its decodes' attention reads (their number times the longest one's
    length, see `StepCost`)."""

    decodes: int
    tokens: int
    keys: int = 0

    @property
    def chunked(self) -> bool:
        """Prompt chunks beside the decodes."""
        return self.tokens > self.decodes


@dataclass(frozen=True)
class PlanPrices:
    """What a plan's nodes are weighed against: a step's seconds without trees (its prompt chunks'
    share left out), what k drafted nodes add (`added[k]`, `StepCost.added_seconds`) plus the
    look that found them (see `_best_plan`), the plain steps' rate (tokens per second) and the
    least a node costs (`StepCost.node_seconds`)."""

    plain_seconds: float
    added: list[float]
    plain_rate: float
    node_seconds: float
    look_seconds: float

    @property
    def seconds(self) -> float:
        """A step's seconds before its nodes: plain, and the look that found them. A plan also pays
        for its look (the last look's at this batch size): a plan found keeps the policy looking
        every step, which a busy server's 32 n-gram searches make 1% of its step, while plain
        steps need no look at all."""
        return self.plain_seconds + self.look_seconds


@dataclass
class TreePlan:
    """The policy's answer for a step: drafted nodes per speculating sequence, and the seconds an
    emitted token is worth at that plan (what a drafter weighs another draft forward against;
    None: no estimate)."""

    tree_budgets: dict[Sequence, int]
    token_seconds: float | None = None


@dataclass
class StepRecord:
    """A step as it ran, all the policy learns from: its shape, its drafted nodes, its seconds from
    the forward to the last emitted token (drafting excluded; None: not timed, the step-cost fit
    learns nothing from it), and every verified tree's drafter, accepted tokens and whether a
    token was then rejected (not the tree's edge reached)."""

    shape: StepShape
    nodes: int
    seconds: float | None
    verified: list[tuple[Drafter, int, bool]] = field(default_factory=list)


@dataclass
class _DrafterRecord:
    accepted: int = 0
    rejected: int = 0  # verify steps that ended in a rejection (not at the tree's edge)
    steps: int = 0  # verify steps
    looks: int = 0  # steps whose plan weighed its sequences by their credited acceptance


class SpeculationPolicy(ABC):
    """What the scheduler asks of a policy (`plan`) and what the engine tells it (`observe`)."""

    @abstractmethod
    def plan(self, caps: Mapping[Sequence, int], shape: StepShape, room: int) -> TreePlan:
        """A tree budget per sequence (each within its cap, its `max_tree_tokens` within the tokens
        it may still emit; all within `room`, the drafted nodes the step has room for) for a step of
        `shape` (its decodes speculating or not; its tokens besides the drafted nodes)."""

    def observe(self, record: StepRecord) -> None:  # noqa: B027 - a fixed policy learns nothing
        """Learn from a step as it ran."""


class FixedPolicy(SpeculationPolicy):
    """Every speculating sequence gets its cap, oldest first, within the step's token budget."""

    def plan(self, caps: Mapping[Sequence, int], shape: StepShape, room: int) -> TreePlan:
        return TreePlan(_caps_within(caps, room))


def _caps_within(caps: Mapping[Sequence, int], room: int) -> dict[Sequence, int]:
    chosen, left = {}, room
    for seq, cap in caps.items():
        chosen[seq] = min(cap, left)
        left -= chosen[seq]
    return chosen


class LookThrottle:
    """When deciding on trees is worth its time, per batch bucket: after a step decided against
    them, the next steps decide nothing until deciding has cost at most `share` of the steps' time
    on average (see DECIDING_SHARE)."""

    def __init__(self, share: float = DECIDING_SHARE):
        self.share = share
        self._skips: dict[int, int] = {}  # steps left that decide nothing
        self._owners: dict[int, int | None] = {}  # the lone sequence they were set for (batch 1)
        self._seconds: dict[int, float] = {}  # what the last look took

    def skip(self, bucket: int, lone: int | None = None) -> bool:
        """Whether this step decides nothing (and counts it). `lone`: the id of a step's only
        sequence, whose skips are its own (another sequence's drafter may guess)."""
        if self._skips.get(bucket, 0) > 0 and self._owners.get(bucket) == lone:
            self._skips[bucket] -= 1
            return True
        self._skips.pop(bucket, None)
        return False

    def last_look(self, bucket: int) -> float:
        return self._seconds.get(bucket, 0.0)

    def looked(self, bucket: int, seconds: float, found: bool, plain_seconds: float, guessed: bool = True,
               lone: int | None = None) -> None:
        self._seconds[bucket] = seconds
        if not found:
            self.declined(bucket, seconds, plain_seconds, guessed, lone)

    def declined(self, bucket: int, seconds: float, plain_seconds: float, guessed: bool = True,
                 lone: int | None = None) -> None:
        """A step decided against trees, which took `seconds` (a look, or the quick bound check:
        at 32 clients, with the caches cold from the forward, that alone took ~90 us a step).
        `guessed`: from this step's guesses, which a lone sequence (`lone`) has looked at every
        step; else from measured acceptance alone."""
        if bucket > _bucket(1) or not guessed:
            self._skips[bucket] = int(seconds / (self.share * plain_seconds))
            self._owners[bucket] = lone


class AdaptivePolicy(SpeculationPolicy):
    """The budgets that maximise the step's expected tokens per second (the module's docstring),
    once the forward's cost curve is known (`calibrate`); until then, the caps."""

    def __init__(self, forward_cost: ForwardCost | None = None, deciding_share: float = DECIDING_SHARE,
                 clock: Callable[[], float] = time.perf_counter):
        self.forward_cost = forward_cost
        self.throttle = LookThrottle(deciding_share)
        self._clock = clock
        # Per drafter object, dying with it: request-named drafters come and go (the engine's cache is bounded).
        self._drafters: weakref.WeakKeyDictionary[Drafter, _DrafterRecord] = weakref.WeakKeyDictionary()
        self._step_costs: dict[int, StepCost] = {}  # by batch bucket (`_bucket` of the decoding sequences)

    def calibrate(self, forward_cost: ForwardCost) -> None:
        """The forward's measured cost curve (`specserve.calibration.load_or_measure`)."""
        self.forward_cost = forward_cost

    # -- measurements -------------------------------------------------------------------------

    def observe(self, record: StepRecord) -> None:
        """Learn from a step: its time at its shape (the step-cost fit), its trees' outcomes."""
        for drafter, accepted, rejected in record.verified:
            entry = self._record(drafter)
            entry.accepted += accepted
            entry.rejected += rejected
            entry.steps += 1
        if self.forward_cost is not None and record.seconds is not None:
            shape = record.shape
            self._step_cost(shape.decodes).add(shape.tokens, record.nodes, record.seconds, shape.chunked, shape.keys)

    def step_seconds(self, shape: StepShape, nodes: int = 0) -> float:
        """Predicted time of a step (without drafting)."""
        return float(self._step_cost(shape.decodes).seconds(shape.tokens, nodes, shape.chunked, shape.keys))

    def _step_cost(self, num_seqs: int) -> StepCost:
        bucket = _bucket(num_seqs)
        if bucket not in self._step_costs:
            self._step_costs[bucket] = StepCost(self.forward_cost)
        return self._step_costs[bucket]

    def acceptance(self, seq: Sequence) -> float:
        """alpha: the probability that the next drafted token is accepted, for this sequence.
        Accepted tokens over accepted and rejected ones (the geometric model's estimate): a step
        whose whole chain was accepted counts no rejection, or a drafter always given one token
        could never look better than one half."""
        record = self._record(seq.drafter)
        prior = (record.accepted + 1) / (record.accepted + record.rejected + 2)
        stats = seq.spec_stats
        return (stats.accepted_tokens + PRIOR_STEPS * prior) / (stats.accepted_tokens + stats.rejections
                                                                + PRIOR_STEPS)

    # -- the decision ---------------------------------------------------------------------------

    def plan(self, caps: Mapping[Sequence, int], shape: StepShape, room: int) -> TreePlan:
        if self.forward_cost is None:
            return TreePlan(_caps_within(caps, room))
        return self._best_budgets(caps, shape, room)

    def _best_budgets(self, caps: Mapping[Sequence, int], shape: StepShape, room: int) -> TreePlan:
        tree_budgets = dict.fromkeys(caps, 0)
        num_seqs, base_tokens, keys = shape.decodes, shape.tokens, shape.keys
        bucket = _bucket(num_seqs)
        lone = next(iter(caps)).seq_id if len(caps) == 1 and num_seqs == 1 else None
        if self.throttle.skip(bucket, lone):  # deciding found nothing lately: this step decides nothing
            return TreePlan(tree_budgets)
        deciding_since = self._clock()
        step_cost = self._step_cost(num_seqs)
        # This step's predicted seconds by drafted nodes (prompt chunks beside the decodes: chunked).
        chunked = shape.chunked
        step_seconds = partial(step_cost.seconds, base_tokens, chunked=chunked, keys=keys)
        plain_seconds = step_seconds(0)
        # Rates are of the step without its prompt chunks (see the module's docstring): counting
        # a chunk's prefill made a token in a prefilling step look worth twice the decode time it
        # saves at 32 clients, and the trees bought there cost what they brought.
        prompt_seconds = max(0.0, plain_seconds - step_cost.seconds(num_seqs, 0, keys=keys)) if chunked else 0.0
        plain_rate = num_seqs / (plain_seconds - prompt_seconds)  # each emits >= 1 token
        plain = TreePlan(tree_budgets, 1.0 / plain_rate)
        seqs = [seq for seq, cap in caps.items() if cap > 0]
        if not seqs or room <= 0:
            return plain
        # The best node is worth less than a node costs, even before drafting: then so is every
        # prefix of nodes. The common case of a busy server, decided first from what each drafter
        # says its surest guess is worth (without asking for every sequence's profile), then
        # from this step's actual guesses.
        node_seconds = step_cost.node_seconds(base_tokens)
        bound = _first_gain_bound(seqs)
        if bound is not None and bound * plain.token_seconds <= node_seconds:
            self.throttle.declined(bucket, self._clock() - deciding_since, plain_seconds)
            return plain
        start = self._clock()
        # A step's seconds by its drafted nodes, its prompt chunks' share left out.
        plan = PlanPrices(plain_seconds - prompt_seconds, step_cost.added_seconds(base_tokens, room), plain_rate,
                          node_seconds, self.throttle.last_look(bucket))
        planner = self._best_depth if len(seqs) == 1 else self._best_plan
        found, guessed = planner(seqs, caps, room, num_seqs, plan)
        self.throttle.looked(bucket, self._clock() - start, found is not None, plain_seconds, guessed, lone)
        if found is None:
            return plain
        budgets, rate = found
        for seq, budget in zip(seqs, budgets, strict=True):
            tree_budgets[seq] = budget
        return TreePlan(tree_budgets, 1.0 / rate)

    def _best_plan(self, seqs: list[Sequence], caps: Mapping[Sequence, int], room: int, num_seqs: int,
                   plan: PlanPrices) -> tuple[tuple[list[int], float] | None, bool]:
        """The best plan's budget per sequence and its rate (None: plain steps are as good: no
        node is worth its price, or the best plan gains less than MIN_RATE_GAIN); and whether
        any sequence was judged by its drafter's guess for this step (`_gains`)."""
        gains, guessed = self._gains(seqs, [caps[seq] for seq in seqs])
        if max(row[0] for row in gains) / plan.plain_rate <= plan.node_seconds:
            return None, guessed
        rows, depths, gains = _nodes_by_gain(np.asarray(gains), [seq.seq_id for seq in seqs], room)
        if not len(rows):
            return None, guessed
        # Rate of every prefix of that order at once (vectorised: this runs every step, for
        # up to max_num_seqs x cap nodes).
        tokens = num_seqs + np.cumsum(gains)
        seconds = plan.seconds + np.asarray(plan.added[1 : len(rows) + 1]) + self._draft_seconds(seqs, rows, depths)
        rates = tokens / seconds
        best = int(np.argmax(rates))
        if rates[best] <= plan.plain_rate * (1 + MIN_RATE_GAIN):
            return None, guessed
        return (np.bincount(rows[: best + 1], minlength=len(seqs)).tolist(), float(rates[best])), guessed

    def _best_depth(self, seqs: list[Sequence], caps: Mapping[Sequence, int], room: int, num_seqs: int,
                    plan: PlanPrices) -> tuple[tuple[list[int], float] | None, bool]:
        """`_best_plan` for one speculating sequence (every step at batch 1), in plain Python: its
        gains fall with depth, so its nodes are its first k and the plan the best k. The arrays'
        version cost a batch-1 step ~0.25 ms (2-3%), numpy's per-call overhead with the caches
        cold from the forward."""
        (seq,) = seqs
        (gains,), guessed = self._gains(seqs, [caps[seq]])
        if gains[0] / plan.plain_rate <= plan.node_seconds:
            return None, guessed
        draft_seconds = seq.drafter.step_cost if isinstance(seq.drafter, Estimates) else None
        best, best_rate, tokens = 0, plan.plain_rate * (1 + MIN_RATE_GAIN), float(num_seqs)
        for k, gain in enumerate(gains[:room], start=1):
            if gain < MIN_GAIN:
                break
            tokens += gain
            rate = tokens / (plan.seconds + plan.added[k] + (draft_seconds(k) if draft_seconds else 0.0))
            if rate > best_rate:
                best, best_rate = k, rate
        return ((best,), best_rate) if best else None, guessed

    def _gains(self, seqs: list[Sequence], caps: list[int]) -> tuple[list[list[float]], bool]:
        """P_r(k) for every sequence r and k = 1..max(caps) (0 beyond its cap): the drafter's
        estimate of this step's proposal, or the sequence's credited acceptance to the k-th
        power; and whether any came from an estimate (a guess for this step, which the next may
        not share)."""
        width = max(caps)
        gains = []
        credited: set[Drafter] = set()
        guessed = False
        for seq, cap in zip(seqs, caps, strict=True):
            estimates = isinstance(seq.drafter, Estimates)
            profile = seq.drafter.acceptance_profile(seq.seq_id, seq.token_ids, cap) if estimates else None
            if profile is None:
                credited.add(seq.drafter)
                alpha = self._credited_alpha(seq)
                profile = [alpha**k for k in range(1, cap + 1)]
            else:
                guessed = True
            row = list(profile[:cap])
            gains.append(row + [0.0] * (width - len(row)))
        for drafter in credited:
            self._record(drafter).looks += 1
        return gains, guessed

    def _credited_alpha(self, seq: Sequence) -> float:
        """Acceptance plus the drafter's exploration credit (see EXPLORE)."""
        record = self._record(seq.drafter)
        explore = EXPLORE * math.sqrt(max(1.0, math.log(1 + record.looks)) / (1 + record.steps))
        return min(0.99, self.acceptance(seq) + explore)

    @staticmethod
    def _draft_seconds(seqs: list[Sequence], rows: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """Drafting time of every prefix of the node order: each drafter grows its deepest tree
        so far (`Estimates.step_cost` of that size), summed over the step's drafters."""
        drafters: dict[Drafter, int] = {}
        drafter_of = np.array([drafters.setdefault(seq.drafter, len(drafters)) for seq in seqs])[rows]
        seconds = np.zeros(len(rows))
        for drafter, index in drafters.items():
            deepest = np.maximum.accumulate(np.where(drafter_of == index, depths, 0))
            if not isinstance(drafter, Estimates):
                continue
            table = np.array([drafter.step_cost(n) for n in range(int(deepest[-1]) + 1)])
            seconds += table[deepest]
        return seconds

    def _record(self, drafter: Drafter) -> _DrafterRecord:
        return self._drafters.setdefault(drafter, _DrafterRecord())


def _bucket(num_seqs: int) -> int:
    """Steps are told apart by batch size to within a factor of two (its bit length)."""
    return num_seqs.bit_length()


def _first_gain_bound(seqs: list[Sequence]) -> float | None:
    """At least P_r(1) for every sequence r, by what the drafters say their surest guesses are
    worth (None: a drafter goes by measured acceptance, which its sequences' gains then tell)."""
    bounds = [d.acceptance_bound() if isinstance(d, Estimates) else None for d in {seq.drafter for seq in seqs}]
    return None if None in bounds else max(bounds)


def _nodes_by_gain(gains: np.ndarray, seq_ids: list[int], room: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (sequence row, k-th drafted node) whose marginal gain `gains[row, k - 1]` (non-
    increasing along a row) is at least MIN_GAIN, best first (ties: shallower node, then older
    sequence), at most `room`: (rows, k, gains)."""
    rows, cols = np.nonzero(gains >= MIN_GAIN)
    values = gains[rows, cols]
    order = np.lexsort((np.asarray(seq_ids)[rows], cols, -values))[:room]
    return rows[order], cols[order] + 1, values[order]
