"""Tree budgets: the adaptive policy speculates where the measured costs make it pay, and not
at all where they do not; the fixed policy hands out caps within the step's token budget."""

from __future__ import annotations

import numpy as np
import pytest

from drafters.ngram import NgramDrafter
from specserve.calibration import calibration_sizes
from specserve.cost_model import ForwardCost, RecentMedian, StepCost, StepFit
from specserve.detokenizer import TextStream
from specserve.sampling import SamplingParams
from specserve.sequence import Sequence
from specserve.speculation import AdaptivePolicy, FixedPolicy, SpeculationPolicy, StepRecord, StepShape


class NullTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


class MeasuredDrafter(NgramDrafter):
    """Judged by its sequences' measured acceptance, as draft models are (no estimate of its own)."""

    def acceptance_profile(self, seq_id, token_ids, max_depth):
        return None

    def acceptance_bound(self):
        return None


DRAFTER = MeasuredDrafter()


def decoding(seq_id: int, accepted: int = 0, steps: int = 0) -> Sequence:
    """A decoding sequence whose speculation so far accepted `accepted` tokens in `steps` steps."""
    seq = Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, prompt_ids=[1, 2, 3],
                   params=SamplingParams(max_tokens=100), text=TextStream(NullTokenizer(), [1, 2, 3]),
                   drafter=DRAFTER, max_tree_tokens=8)
    for _ in range(steps):
        seq.spec_stats.record(8, 0)
    seq.spec_stats.accepted_tokens = accepted
    return seq


def plan_budgets(policy: SpeculationPolicy, caps: dict, base_tokens: int, room: int, num_seqs: int | None = None,
            keys: int = 0) -> dict:
    """The policy's tree budgets for a step of `base_tokens` tokens, `num_seqs` of them decodes
    (default: the speculating sequences)."""
    shape = StepShape(len(caps) if num_seqs is None else num_seqs, base_tokens, keys)
    return policy.plan(caps, shape, room).tree_budgets


def observe_step(policy: SpeculationPolicy, num_seqs: int, base_tokens: int, nodes: int, seconds: float,
                 keys: int = 0) -> None:
    """A step of that shape and drafted nodes took `seconds`."""
    policy.observe(StepRecord(StepShape(num_seqs, base_tokens, keys), nodes, seconds))


def observe_verify(policy: SpeculationPolicy, drafter, accepted: int, rejected: bool = True) -> None:
    """A tree of `drafter`'s was verified (in a step not timed)."""
    policy.observe(StepRecord(StepShape(1, 1), 1, None, [(drafter, accepted, rejected)]))


def step_seconds(policy: SpeculationPolicy, num_seqs: int, base_tokens: int, nodes: int = 0) -> float:
    return policy.step_seconds(StepShape(num_seqs, base_tokens), nodes)


def adaptive_policy(cost: ForwardCost) -> SpeculationPolicy:
    """The adaptive policy on a clock that stands still: every look is free, so none is skipped
    (the one test of skipping sets its own clock)."""
    return AdaptivePolicy(cost, clock=lambda: 0.0)


FLAT = ForwardCost([1, 64, 512], [0.050, 0.060, 0.400])  # rows nearly free up to 64 (a CPU at batch 1)
STEEP = ForwardCost([1, 512], [0.050, 0.050 * 512])  # every row costs a whole forward


def test_cheap_rows_and_good_acceptance_buy_deep_trees():
    policy = adaptive_policy(FLAT)
    seq = decoding(0, accepted=90, steps=10)  # ~0.9 per drafted token
    assert plan_budgets(policy, {seq: 8}, base_tokens=1, room=100)[seq] == 8


def test_poor_acceptance_gets_fewer_nodes_than_good_acceptance():
    policy = adaptive_policy(ForwardCost([1, 2, 512], [0.05, 0.058, 4.0]))
    good, poor = decoding(0, accepted=90, steps=10), decoding(1, accepted=1, steps=40)
    budgets = plan_budgets(policy, {good: 8, poor: 8}, base_tokens=2, room=100)
    assert budgets[good] > budgets[poor]


def test_when_rows_cost_a_forward_each_nothing_is_speculated():
    policy = adaptive_policy(STEEP)
    seqs = [decoding(i, accepted=50, steps=10) for i in range(4)]
    assert set(plan_budgets(policy, dict.fromkeys(seqs, 8), base_tokens=4, room=100).values()) == {0}


def test_speculation_shrinks_as_the_batch_grows():
    """Forward time linear beyond 64 rows: a big batch has no spare rows to speculate with."""
    cost = ForwardCost([1, 64, 512], [0.05, 0.06, 0.50])
    policy = adaptive_policy(cost)
    totals = []
    for batch in (1, 8, 256):
        seqs = [decoding(i, accepted=10, steps=10) for i in range(batch)]  # ~0.5 per drafted token
        chosen = plan_budgets(policy, dict.fromkeys(seqs, 8), base_tokens=batch, room=1024)
        totals.append(sum(chosen.values()) / batch)
    assert totals[0] >= totals[1] > totals[2] == 0


class CostlyDrafter(MeasuredDrafter):
    def step_cost(self, tree_budget: int) -> float:
        return 0.05 * tree_budget  # a whole forward per drafted node


def test_the_drafters_cost_is_charged():
    free, costly = decoding(0, accepted=30, steps=10), decoding(1, accepted=30, steps=10)
    costly.drafter = CostlyDrafter()
    policy = adaptive_policy(FLAT)
    assert plan_budgets(policy, {costly: 8}, 1, 100)[costly] < plan_budgets(policy, {free: 8}, 1, 100)[free]


def test_measured_steps_correct_the_curve_and_trees_that_slow_steps_down_stop():
    policy = adaptive_policy(FLAT)
    seqs = [decoding(i, accepted=12, steps=10) for i in range(32)]  # ~0.55 per drafted token
    assert sum(plan_budgets(policy, dict.fromkeys(seqs, 8), 32, 1024).values()) > 0  # trees look nearly free
    for nodes in range(1, 33):
        observe_step(policy, 32, 32, 0, seconds=FLAT(32))
        observe_step(policy, 32, 32, nodes, seconds=FLAT(32) * (1 + nodes / 32))  # 32 nodes: twice as slow
    assert step_seconds(policy, 32, 32) == pytest.approx(FLAT(32), rel=0.01)
    assert sum(plan_budgets(policy, dict.fromkeys(seqs, 8), 32, 1024).values()) == 0
    assert plan_budgets(policy, {seqs[0]: 8}, 1, 1024)[seqs[0]] > 0  # batch 1 was never measured slower


def test_a_node_is_priced_as_measured_not_as_the_curves_slope():
    """8 decodes, where the single-chain curve says 8 more rows cost 2%: measured, each node
    costs 2% of the step. The 8 sequences' first nodes (worth 0.25 tokens, 3% of the step's
    8) still pay; their second nodes (0.06 tokens, under 1%) do not."""
    policy = adaptive_policy(FLAT)
    for step in range(300):  # the drafter's record: 1 in 4 drafted tokens accepted, long explored
        observe_verify(policy, DRAFTER, int(step % 3 == 0))
    seqs = [decoding(i, accepted=4, steps=12) for i in range(8)]  # alpha = 0.25
    assert sum(plan_budgets(policy, dict.fromkeys(seqs, 8), 8, 1024).values()) > 8  # the curve: deep trees
    plain = FLAT(8)
    for nodes in (0, 4, 8, 12, 16, 0, 6, 10):
        observe_step(policy, 8, 8, nodes, seconds=plain * (1 + 0.02 * nodes))
    assert step_seconds(policy, 8, 8, 10) == pytest.approx(1.2 * plain)
    assert plan_budgets(policy, dict.fromkeys(seqs, 8), 8, 1024) == dict.fromkeys(seqs, 1)


def test_trees_measured_faster_than_the_curve_do_not_make_unmeasured_plain_steps_look_dear():
    """A speculating engine at load seldom runs a plain step, so only its tree steps get measured.
    Came out faster than the calibration (0.7x), they must not make speculation look like it
    saves time on a step (what a plain step at the calibration's 1.0x would suggest)."""
    policy = adaptive_policy(STEEP)
    seqs = [decoding(i, accepted=10, steps=10) for i in range(8)]  # ~0.5 per drafted token
    for _ in range(5):
        observe_step(policy, 8, 8, 8, seconds=0.7 * STEEP(16))
    assert step_seconds(policy, 8, 8) == pytest.approx(0.7 * STEEP(8))
    assert sum(plan_budgets(policy, dict.fromkeys(seqs, 8), 8, 1024).values()) == 0  # every row costs a forward


def test_one_slow_step_does_not_switch_speculation_off_for_good():
    """A warm-up outlier (a new shape's first forward) must not leave trees looking dear: with
    no trees, nothing would measure them again."""
    policy = adaptive_policy(FLAT)
    seq = decoding(0, accepted=30, steps=10)
    observe_step(policy, 1, 1, 8, seconds=20 * FLAT(9))
    assert plan_budgets(policy, {seq: 8}, 1, 1024)[seq] > 0
    for _ in range(3):
        observe_step(policy, 1, 1, 8, seconds=FLAT(9))
    assert step_seconds(policy, 1, 1, 8) == pytest.approx(FLAT(9))


def test_step_cost_fits_scale_and_price_per_node_through_outliers():
    cost = StepCost(FLAT, window=32)
    assert cost.fit() == StepFit()  # nothing measured: the curve as it is
    plain = FLAT(8)
    for i, nodes in enumerate([0, 3, 6, 9, 12] * 4):
        slow = 5.0 if i in (3, 11) else 1.0  # a noisy neighbour, twice
        cost.add(8, nodes, slow * (0.8 * plain + 0.002 * nodes))
    fit = cost.fit()
    row = FLAT(9) - FLAT(8)  # what the curve says a row costs; a node pays the rest of its 2 ms on top
    assert (fit.fixed, fit.scale, fit.tree_overhead, fit.per_node) == pytest.approx((0.0, 0.8, 0.0, 0.002 - 0.8 * row))
    assert cost.seconds(8, np.array([0, 10])) == pytest.approx([0.8 * plain, 0.8 * plain + 0.02])


def test_a_busy_servers_plain_steps_do_not_make_it_forget_what_its_few_trees_cost():
    cost = StepCost(FLAT, window=8)
    for _ in range(3):
        cost.add(64, 0, FLAT(64))
        cost.add(64, 2, FLAT(64) * 1.2)  # two nodes padded every decode's attention: +20%
    for _ in range(100):
        cost.add(64, 0, FLAT(64))
    assert cost.node_seconds(64) == pytest.approx(0.1 * FLAT(64))


def test_trees_found_dear_are_measured_again_after_a_while():
    """Dear trees are not drafted, so nothing re-measures them: after `tree_memory` steps their
    samples are forgotten and trees are priced as the plain steps say, until measured anew."""
    cost = StepCost(FLAT, window=8, tree_memory=50)
    for _ in range(3):
        cost.add(64, 0, FLAT(64))
        cost.add(64, 2, FLAT(64) * 1.2)  # a noisy moment: trees looked dear
    dear = cost.seconds(64, 2)
    for _ in range(40):
        cost.add(64, 0, FLAT(64))
    assert cost.seconds(64, 2) == pytest.approx(dear)  # still remembered
    for _ in range(10):
        cost.add(64, 0, FLAT(64))
    assert cost.seconds(64, 2) == pytest.approx(FLAT(66))  # forgotten: the curve's price


def test_step_cost_tells_what_having_trees_costs_from_what_each_node_costs():
    cost = StepCost(FLAT)
    for nodes in (0, 2, 0, 8, 0, 16, 0, 4):
        cost.add(64, nodes, FLAT(64) * (1.0 + (0.05 if nodes else 0.0)) + 0.001 * nodes)
    fit = cost.fit()
    beyond_row = 0.001 - (FLAT(65) - FLAT(64))  # a node's millisecond, less its row on the curve
    assert (fit.fixed, fit.scale, fit.tree_overhead, fit.per_node) == pytest.approx((0.0, 1.0, 0.05 * FLAT(64),
                                                                                     beyond_row))
    assert cost.seconds(64, np.array([0, 1, 10])) == pytest.approx(FLAT(64) * np.array([1.0, 1.05, 1.05])
                                                                   + [0.0, 0.001, 0.01])


def test_a_busy_step_where_one_small_tree_is_dear_still_drafts_many_nodes_that_pay():
    """64 decodes: any tree costs the step 10%, each node then 0.1% (its rows fill the matmul
    tiles). One node (0.4 tokens, 0.6% of the step's 64) does not pay for the 10%; dozens at
    once do, and the policy takes them together."""
    curve = ForwardCost([1, 64, 128], [0.050, 0.060, 0.064])
    policy = adaptive_policy(curve)
    for step in range(300):
        observe_verify(policy, DRAFTER, int(step % 5 < 2))  # long explored, 0.4 accepted
    for nodes in (0, 2, 0, 8, 0, 16, 0, 32):
        observe_step(policy, 64, 64, nodes, curve(64) * (1.0 + (0.1 if nodes else 0.0) + 0.001 * nodes))
    seqs = [decoding(i, accepted=40, steps=60) for i in range(64)]  # alpha = 0.4
    assert sum(plan_budgets(policy, dict.fromkeys(seqs, 8), 64, 1024).values()) >= 32
    lone = {seqs[0]: 8}  # one sequence's tree alone cannot pay for the overhead
    assert sum(plan_budgets(policy, lone, 64, 1024, num_seqs=64).values()) == 0


BATCH = ForwardCost([1, 32, 64, 128, 512], [0.015, 0.028, 0.042, 0.077, 0.338])  # SmolLM2, bf16, 2 cores


def test_a_busy_batchs_own_attention_is_not_charged_to_each_drafted_node():
    """64 decodes over long contexts take 2.7x the one-sequence curve's 64 rows: the rest is the
    batch's attention, which an extra row does not repeat. A node costs a row, not 2.7 rows."""
    cost = StepCost(BATCH)
    for _ in range(5):
        cost.add(64, 0, 2.7 * BATCH(64))
    fit = cost.fit()
    assert (fit.fixed, fit.scale) == pytest.approx((1.7 * BATCH(64), 1.0))
    assert cost.node_seconds(64) == pytest.approx(BATCH(65) - BATCH(64))


def test_prompt_chunks_tell_a_rows_price_from_the_batchs_fixed_cost():
    cost = StepCost(BATCH)
    for chunk in (0, 0, 100, 0, 300, 50, 0, 448):
        cost.add(64 + chunk, 0, 0.070 + 0.8 * BATCH(64 + chunk))
    fit = cost.fit()
    assert (fit.fixed, fit.scale) == pytest.approx((0.070, 0.8))
    assert cost.node_seconds(64) == pytest.approx(0.8 * (BATCH(65) - BATCH(64)))


def test_steps_that_prefilled_do_not_make_decode_steps_look_dear():
    """A prompt chunk's attention is a call of its own: a step with one pays 10 ms beyond its
    rows. Decode steps, most of a busy server's, are priced as measured, not as the average of
    both kinds; else every tree measured against them would look cheaper than it is."""
    cost = StepCost(BATCH)
    for chunk in (0, 40, 0, 100, 0, 20, 0, 60, 0, 80):
        cost.add(64 + chunk, 0, 0.018 + BATCH(64 + chunk) + (0.010 if chunk else 0.0), chunked=chunk > 0)
    assert cost.seconds(64, 0) == pytest.approx(0.018 + BATCH(64))
    assert cost.seconds(114, 0, chunked=True) == pytest.approx(0.028 + BATCH(114))
    for nodes in (8, 16, 32):
        cost.add(64, nodes, 0.018 + BATCH(64) + 0.003 + 0.0006 * nodes)
    assert cost.seconds(64, 10) == pytest.approx(0.018 + BATCH(64) + 0.003 + 0.006)


def test_a_long_sequence_joining_the_batch_is_priced_from_its_first_step():
    """32 decodes' attention is padded to their longest sequence: one long prompt joining makes
    every decode read twice the keys. The window's steps, which differed in keys, price a key,
    so the next step is priced as it will be, not as the last dozens were."""
    cost = StepCost(BATCH)
    for keys in (8000, 9000, 8500, 12000, 9500, 8000, 10000, 11000):
        cost.add(32, 0, 0.010 + 3e-6 * keys + BATCH(32), keys=keys)
    assert cost.seconds(32, 0, keys=20000) == pytest.approx(0.010 + 0.060 + BATCH(32))
    for nodes in (4, 8, 16):  # and trees are priced apart from the keys their steps read
        cost.add(32, nodes, 0.010 + 3e-6 * 16000 + BATCH(32) + 0.002 + 0.001 * nodes, keys=16000)
    assert cost.seconds(32, 10, keys=8000) == pytest.approx(0.010 + 0.024 + BATCH(32) + 0.002 + 0.010)


def test_a_busy_batch_drafts_the_guesses_worth_more_than_a_row():
    """64 decodes, each of their tokens worth 2.7 * T(64) / 64 = 1.8 ms of the step, a row 0.55 ms:
    sure guesses (0.7) pay, even if the step's measured / calibrated ratio says 2.7."""
    policy = adaptive_policy(BATCH)
    for step in range(300):
        observe_verify(policy, DRAFTER, int(step % 10 < 7))  # long explored, 0.7 accepted
    for _ in range(5):
        observe_step(policy, 64, 64, 0, 2.7 * BATCH(64))
    seqs = [decoding(i, accepted=70, steps=30) for i in range(64)]  # alpha = 0.7
    assert sum(plan_budgets(policy, dict.fromkeys(seqs, 8), 64, 1024).values()) >= 64


def test_a_machine_that_slows_down_is_noticed_within_a_few_steps():
    """Past a window's first samples, the fit is redone only after a second of steps (every
    step would cost a small batch's step a measurable share), but a slower machine still shows
    within them."""
    cost = StepCost(FLAT, window=10)
    for _ in range(10):
        cost.add(8, 0, FLAT(8))
    assert cost.seconds(8, 0) == pytest.approx(FLAT(8))
    for _ in range(10):  # a second of them
        cost.add(8, 0, 2 * FLAT(8))
    assert cost.seconds(8, 0) == pytest.approx(2 * FLAT(8))


def test_past_its_first_samples_a_window_is_refitted_after_a_second_of_steps_not_every_step():
    """A refit costs a busy step a measurable share: after a window's first samples (each
    fitted at once), new samples wait for the next refit."""
    cost = StepCost(FLAT, window=32)
    for _ in range(6):
        cost.add(8, 0, FLAT(8))
        assert cost.seconds(8, 0) == pytest.approx(FLAT(8))
    cost.add(8, 0, 0.2)
    fitted = cost.fit()
    cost.add(8, 0, 0.2)
    assert cost.fit() is fitted
    for _ in range(3):
        cost.add(8, 0, 0.3)
    assert cost.fit() is not fitted  # a second of steps since


def test_a_node_never_costs_less_than_its_rows_on_the_curve():
    cost = StepCost(STEEP)
    for nodes in (0, 4, 8, 16):
        cost.add(1, nodes, STEEP(1))  # nodes measured free: noise, or a lucky machine
    fit = cost.fit()
    assert fit.per_node == 0.0  # not below
    assert cost.seconds(1, 8) - cost.seconds(1, 0) == pytest.approx(fit.scale * (STEEP(9) - STEEP(1)))


def test_recent_median_waits_for_samples_and_ignores_outliers():
    times = RecentMedian(window=4, min_samples=3)
    times.add(5.0)
    times.add(0.1)
    assert times.value is None
    times.add(0.2)
    assert times.value == 0.2
    for value in (0.3, 0.3, 0.3):  # the window forgets the oldest
        times.add(value)
    assert times.value == pytest.approx(0.3)


def test_a_new_sequence_starts_from_its_drafters_acceptance():
    policy = adaptive_policy(FLAT)
    fresh = decoding(0)
    before = policy.acceptance(fresh)
    for _ in range(50):
        observe_verify(policy, DRAFTER, accepted=0)
    assert policy.acceptance(fresh) < before < 1


def test_chains_accepted_to_their_end_do_not_count_as_rejections():
    """A drafter given one token a step and right every time: its acceptance is not capped at one
    half by counting each step's end as a rejection (the geometric model's censored steps)."""
    policy = adaptive_policy(FLAT)
    seq = decoding(0)
    for _ in range(20):
        seq.spec_stats.record(1, 1, rejected=False)
        observe_verify(policy, DRAFTER, accepted=1, rejected=False)
    assert policy.acceptance(seq) > 0.9


DEAR_NODE = ForwardCost([1, 2, 512], [0.05, 0.08, 4.0])  # a drafted node costs 60% of a decode


def test_a_drafter_judged_on_one_unlucky_step_is_tried_again_after_a_while():
    """Its first tree was rejected outright (a draft model's first guess after a prompt often
    differs in style alone): plain steps follow, but the credit of a drafter not tried grows
    with the steps that weighed it, and it is tried again."""
    policy = adaptive_policy(DEAR_NODE)
    seq = decoding(0)
    assert plan_budgets(policy, {seq: 1}, base_tokens=1, room=8)[seq] == 1
    seq.spec_stats.record(1, 0)
    observe_verify(policy, DRAFTER, accepted=0)
    plain = 0
    while plan_budgets(policy, {seq: 1}, base_tokens=1, room=8)[seq] == 0:
        plain += 1
        assert plain < 100
    assert plain >= 1


def test_fixed_budgets_are_the_caps_within_the_token_budget():
    policy = FixedPolicy()
    a, b, c = decoding(0), decoding(1), decoding(2)
    assert plan_budgets(policy, {a: 8, b: 8, c: 8}, base_tokens=3, room=12) == {a: 8, b: 4, c: 0}


def test_forward_cost_interpolates_between_measured_sizes():
    cost = ForwardCost([1, 8, 32], [0.01, 0.02, 0.05])
    assert cost(1) == pytest.approx(0.01) and cost(8) == pytest.approx(0.02)
    assert cost(20) == pytest.approx(0.035) and cost(64) == pytest.approx(0.09)  # the last segment extended
    sizes = np.array([0, 1, 5, 8, 20, 32, 64, 100])
    assert cost.many(sizes) == pytest.approx([cost(int(n)) for n in sizes])


def test_calibration_is_dense_where_a_busy_batch_and_its_trees_sit():
    """Matmuls grow in steps with their rows: every 4 rows up to 128 are measured."""
    assert calibration_sizes(512) == [1, 2, *range(4, 129, 4), 256, 512]
    assert calibration_sizes(100) == [1, 2, *range(4, 100, 4), 100]


def test_forward_cost_never_falls_with_more_tokens():
    """Timing noise made 2 tokens look cheaper than 1: the curve takes their mean for both (the
    least-squares non-decreasing curve), and the sizes after them keep their own."""
    cost = ForwardCost([1, 2, 4, 8], [0.063, 0.055, 0.065, 0.069])
    assert cost(2) == pytest.approx(0.059) and cost(1) == pytest.approx(0.059)
    assert cost(4) == pytest.approx(0.065) and cost(8) == pytest.approx(0.069)
    sizes = np.arange(1, 64)
    assert np.all(np.diff([cost(int(n)) for n in sizes]) >= 0)


class KnowingDrafter(MeasuredDrafter):
    """Knows before drafting what each sequence's proposal is worth (as n-gram lookup does)."""

    def __init__(self, first_token: dict[int, float]):
        super().__init__()
        self.first_token = first_token
        self.asked = 0

    def acceptance_profile(self, seq_id, token_ids, max_depth):
        self.asked += 1
        return self.first_token[seq_id] * 0.8 ** np.arange(max_depth)

    def acceptance_bound(self):
        return max(self.first_token.values())


def known_guesses(first_token: dict[int, float]) -> tuple[list[Sequence], KnowingDrafter]:
    """Decoding sequences 0..n-1, drafted by a drafter that knows each one's first guess's worth."""
    drafter = KnowingDrafter(first_token)
    seqs = [decoding(i) for i in range(len(first_token))]
    for seq in seqs:
        seq.drafter = drafter
    return seqs, drafter


def policy_whose_looks_take(share: float, cost: ForwardCost) -> SpeculationPolicy:
    """The adaptive policy on a clock by which every look takes `share` of a 64-decode step."""
    now = [0.0]

    def clock() -> float:
        now[0] += share * cost(64)
        return now[0]

    return AdaptivePolicy(cost, clock=clock)


def test_a_busy_step_verifies_just_the_guesses_its_drafter_is_confident_of():
    """64 sequences at a measured 45% acceptance each: no node pays where a node costs half a
    token's worth. Told that 8 of this step's guesses are 90% sure and the rest 40%, the policy
    verifies those 8 and nothing else."""
    cost = ForwardCost([1, 64, 128], [0.05, 0.2, 0.3])  # beyond 64 rows, a node costs ~half a token
    seqs = [decoding(i, accepted=45, steps=55) for i in range(64)]
    policy = adaptive_policy(cost)
    for step in range(400):  # long explored
        observe_verify(policy, DRAFTER, step % 2)
    assert set(plan_budgets(policy, dict.fromkeys(seqs, 8), 64, 1024).values()) == {0}
    drafter = KnowingDrafter({seq.seq_id: 0.9 if seq.seq_id % 8 == 0 else 0.4 for seq in seqs})
    for seq in seqs:
        seq.drafter = drafter
    budgets = plan_budgets(policy, dict.fromkeys(seqs, 8), 64, 1024)
    assert all(budgets[seq] > 0 for seq in seqs if seq.seq_id % 8 == 0)
    assert all(budgets[seq] == 0 for seq in seqs if seq.seq_id % 8)


def test_a_busy_step_that_no_guess_could_pay_for_asks_no_sequence_what_its_guess_is_worth():
    """Where the drafter's surest kind of guess is worth less than a node costs, the policy
    decides from that bound alone: 64 profile look-ups a step are what a busy server can spare."""
    cost = ForwardCost([1, 64, 128], [0.05, 0.2, 0.3])  # beyond 64 rows, a node costs ~half a token
    seqs, drafter = known_guesses(dict.fromkeys(range(64), 0.4))
    policy = adaptive_policy(cost)
    assert set(plan_budgets(policy, dict.fromkeys(seqs, 8), 64, 1024).values()) == {0}
    assert drafter.asked == 0
    for seq_id in range(0, 64, 4):  # now some guesses may pay: every sequence's is looked at
        drafter.first_token[seq_id] = 0.95
    assert plan_budgets(policy, dict.fromkeys(seqs, 8), 64, 1024)[seqs[4]] > 0
    assert drafter.asked == 64


def test_a_plan_that_promises_next_to_nothing_is_not_worth_its_trees():
    """One sure guess among 64 decodes buys under 2% more tokens per second even at the curve's
    price: within what the fit cannot tell, so the step runs plain."""
    cost = ForwardCost([1, 64, 128], [0.05, 0.06, 0.064])  # nodes nearly free
    seqs, drafter = known_guesses(dict.fromkeys(range(64), 0.0) | {0: 0.95})
    policy = adaptive_policy(cost)
    assert set(plan_budgets(policy, dict.fromkeys(seqs, 1), 64, 1024).values()) == {0}
    drafter.first_token |= dict.fromkeys(range(8), 0.95)  # eight of them: 12% more tokens
    assert sum(plan_budgets(policy, dict.fromkeys(seqs, 1), 64, 1024).values()) == 8


def test_a_busy_server_that_keeps_finding_nothing_worth_drafting_looks_less_often():
    """Looking at 64 guesses took 1% of a step and found nothing that pays: the next five looks
    are skipped (looking costs 0.2% of the steps on average), then the policy looks again."""
    cost = ForwardCost([1, 64, 128], [0.05, 0.2, 0.3])
    policy = policy_whose_looks_take(0.01, cost)
    seqs, drafter = known_guesses(dict.fromkeys(range(64), 0.4) | {0: 0.95})  # one guess may pay, alone not enough
    for _ in range(7):
        assert set(plan_budgets(policy, dict.fromkeys(seqs, 8), 64, 1024).values()) == {0}
    assert drafter.asked == 2 * 64  # looked at the first step and the seventh


def test_a_busy_server_whose_surest_guess_could_not_pay_decides_less_often_too():
    """The quick bound check (no sequence asked) is deciding too, and at a busy server with the
    caches cold from the forward it is not free: where it took 1% of a step, the next five steps
    decide nothing, even once guesses that would pay appear; the seventh drafts them."""
    cost = ForwardCost([1, 64, 128], [0.05, 0.2, 0.3])
    policy = policy_whose_looks_take(0.01, cost)
    seqs, drafter = known_guesses(dict.fromkeys(range(64), 0.4))
    assert set(plan_budgets(policy, dict.fromkeys(seqs, 8), 64, 1024).values()) == {0}
    for seq_id in range(0, 64, 4):
        drafter.first_token[seq_id] = 0.95
    for _ in range(5):
        assert set(plan_budgets(policy, dict.fromkeys(seqs, 8), 64, 1024).values()) == {0}
    assert drafter.asked == 0
    assert plan_budgets(policy, dict.fromkeys(seqs, 8), 64, 1024)[seqs[4]] > 0


def test_a_single_sequence_is_looked_at_every_step_however_long_its_looks_take():
    """At batch 1 a skipped look is a whole step without speculation: a look that found nothing
    worth a node (each row costs nearly a step; the guess is 90% sure), though it took three
    steps' time, is not followed by steps that decide nothing."""
    cost = ForwardCost([1, 128], [0.05, 5.76])
    policy = policy_whose_looks_take(0.05, cost)
    seqs, drafter = known_guesses({0: 0.9})
    for _ in range(3):
        assert plan_budgets(policy, dict.fromkeys(seqs, 8), 1, 1024) == {seqs[0]: 0}
    assert drafter.asked == 3


def test_a_lone_sequence_judged_by_measured_acceptance_is_not_looked_at_again_until_looking_is_paid_for():
    """A drafter that guesses nothing of its own (a model, a head) is judged by measured
    acceptance, which steps without trees leave as it was: at batch 1 too, after a look that
    found nothing worth a node took 1% of a step, the next four steps decide nothing. Another
    sequence is looked at at once (its drafter may guess)."""
    cost = ForwardCost([1, 128], [0.05, 5.76])  # each row costs nearly a step
    reads = []

    def clock() -> float:  # each reading 1% of a step later
        reads.append(None)
        return len(reads) * 0.01 * cost(1)

    policy = AdaptivePolicy(cost, clock=clock)
    drafter = MeasuredDrafter()
    lone, other = decoding(0, accepted=1, steps=40), decoding(1, accepted=1, steps=40)
    lone.drafter = other.drafter = drafter
    assert plan_budgets(policy, {lone: 8}, 1, 1024) == {lone: 0}
    looked = len(reads)
    for _ in range(4):
        assert plan_budgets(policy, {lone: 8}, 1, 1024) == {lone: 0}
    assert len(reads) == looked, "steps that decide nothing read no clock"
    assert plan_budgets(policy, {other: 8}, 1, 1024) == {other: 0}
    assert len(reads) > looked


def test_a_plan_pays_for_the_look_that_found_it():
    """Eight sure guesses among 64 decodes buy 12% more tokens per second, where nodes are nearly
    free: drafted while the policy does not know what looking costs. Once a look is known to
    take 15% of a step, which a plan found makes the policy pay again at the next step, they are
    not worth it."""
    cost = ForwardCost([1, 64, 128], [0.05, 0.06, 0.064])
    policy = policy_whose_looks_take(0.15, cost)
    seqs, _ = known_guesses(dict.fromkeys(range(64), 0.0) | dict.fromkeys(range(8), 0.95))
    assert sum(plan_budgets(policy, dict.fromkeys(seqs, 1), 64, 1024).values()) == 8
    assert sum(plan_budgets(policy, dict.fromkeys(seqs, 1), 64, 1024).values()) == 0


def test_nodes_are_priced_by_the_rows_they_add_where_the_matmuls_grow_in_steps():
    """32 decodes on a CPU whose matmuls grow in steps (as measured for SmolLM2 in bf16 on 2
    cores): rows 33-40 cost 0.1 ms each, rows 41-44 1 ms each, rows 45-48 0.25 ms. Sixteen
    sequences each have a 60% guess (worth 0.6 of a token, 0.6 ms): the first eight nodes pay,
    the next ones cost more than they bring, even taken eight at a time, so the policy stops at
    eight. (A price per node averaged over 32 to 64 rows, 0.25 ms, would take all sixteen.)"""
    curve = ForwardCost([1, 32, 40, 44, 48, 64], [0.015, 0.032, 0.0328, 0.0368, 0.0378, 0.040])
    step = StepCost(curve)
    assert step.seconds(32, 8) - step.seconds(32, 0) == pytest.approx(0.0008)
    assert step.seconds(32, 12) - step.seconds(32, 8) == pytest.approx(0.004)
    assert step.node_seconds(32) == pytest.approx(0.0001)  # the cheapest a node gets
    seqs, _ = known_guesses(dict.fromkeys(range(16), 0.6) | dict.fromkeys(range(16, 32), 0.0))
    policy = adaptive_policy(curve)
    assert sum(plan_budgets(policy, dict.fromkeys(seqs, 1), 32, 1024).values()) == 8


def test_a_token_is_worth_the_decode_time_it_saves_not_a_share_of_a_prefill():
    """32 decodes take 50 ms (1.6 ms a token); a step that also prefills a 200-token prompt
    chunk takes 100 ms. Guesses worth 0.6 of a token (1 ms) do not pay for nodes at 1.25 ms
    each, prompt chunk or not: the chunk is prefilled whatever is drafted, so the tokens of a
    prefilling step are worth no more (valued at 100 ms / 32, they would have looked worth 1.9 ms)."""
    curve = ForwardCost([1, 32, 64, 232, 264], [0.015, 0.030, 0.070, 0.080, 0.120])  # 1.25 ms a row past 32 and 232
    policy = adaptive_policy(curve)
    for _ in range(4):
        observe_step(policy, 32, 32, 0, 0.050)
        observe_step(policy, 32, 232, 0, 0.100)
    seqs, _ = known_guesses(dict.fromkeys(range(32), 0.6))
    assert sum(plan_budgets(policy, dict.fromkeys(seqs, 1), 32, 1024).values()) == 0
    prefilling = policy.plan(dict.fromkeys(seqs, 1), StepShape(32, 232), 1024)
    assert sum(prefilling.tree_budgets.values()) == 0
    assert prefilling.token_seconds == pytest.approx(0.050 / 32)


class ProfileDrafter(MeasuredDrafter):
    """Says its proposal's worth is `profile` and drafting k nodes costs `per_node` * k seconds."""

    def __init__(self, profile: list[float], per_node: float):
        super().__init__()
        self.profile, self.per_node = profile, per_node

    def acceptance_profile(self, seq_id, token_ids, max_depth):
        return self.profile[:max_depth]

    def step_cost(self, tree_budget: int) -> float:
        return self.per_node * tree_budget


@pytest.mark.parametrize("seed", range(3))
def test_a_lone_sequence_is_planned_as_the_plan_for_many_would_plan_it(seed: int):
    """Batch 1 takes a plain-Python path (numpy's per-call cost was most of its plan): the same
    budget and rate as the arrays' plan on random curves, guesses and drafting costs."""
    from specserve.speculation import PlanPrices

    rng = np.random.default_rng(seed)
    for _ in range(200):
        curve = ForwardCost([1, 8, 64, 512], np.cumsum(rng.uniform(0.001, 0.02, 4)).tolist())
        cap = int(rng.integers(1, 17))
        profile = np.cumprod(rng.uniform(0.3, 1.0, cap)).tolist()
        seq = decoding(0)
        seq.drafter = ProfileDrafter(profile, float(rng.choice([0.0, 0.0005])))
        if rng.random() < 0.3:  # judged by measured acceptance instead
            seq.drafter = MeasuredDrafter()
            seq.spec_stats.accepted_tokens = int(rng.integers(0, 50))
        policy = adaptive_policy(curve)
        step = policy._step_cost(1)
        room = int(rng.integers(1, 20))
        prices = PlanPrices(step.seconds(1, 0), step.added_seconds(1, room), 1 / step.seconds(1, 0),
                            step.node_seconds(1), float(rng.choice([0.0, 0.001])))
        lone, _ = policy._best_depth([seq], {seq: cap}, room, 1, prices)
        general, _ = policy._best_plan([seq], {seq: cap}, room, 1, prices)
        if general is None:
            assert lone is None
        else:
            assert list(lone[0]) == general[0] and lone[1] == pytest.approx(general[1], rel=1e-12)
