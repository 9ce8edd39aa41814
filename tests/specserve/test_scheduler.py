"""The continuous batcher, without a model: who runs each step, with how many tokens, and what
happens when the KV pool runs out."""

from __future__ import annotations

import random

import pytest

from specserve.admission import DECAY_STEPS, INITIAL_RATIO, MIN_RATIO_FACTOR, RESUME_STEPS, NewTokenRatio
from specserve.block_manager import BlockManager
from specserve.config import EngineConfig
from specserve.detokenizer import TextStream
from specserve.sampling import SamplingParams
from specserve.scheduler import Scheduler, StepPlan
from specserve.sequence import Sequence, SequenceStatus

BLOCK = 4


class NullTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 8, waits_for: Sequence | None = None,
             prefix: list[int] | None = None) -> Sequence:
    """A sequence whose prompt is `prefix` (if any), then `prompt_len` tokens distinct per sequence."""
    prompt = (prefix or []) + [(seq_id * 7 + i) % 50 + 1 for i in range(prompt_len)]
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, prompt_ids=prompt,
                    params=SamplingParams(max_tokens=max_tokens), text=TextStream(NullTokenizer(), prompt),
                    waits_for=waits_for)


def make_scheduler(num_blocks=64, **options) -> Scheduler:
    config = EngineConfig(block_size=BLOCK, **{"max_num_batched_tokens": 16, "max_num_seqs": 8, **options})
    return Scheduler(config, BlockManager(num_blocks, BLOCK))


def run_step(scheduler: Scheduler, plan: StepPlan, next_token: int = 99) -> None:
    """What the engine does after the forward: advance, commit, sample, finish."""
    for s in plan.scheduled:
        s.seq.num_computed += s.num_tokens
        scheduler.blocks.commit(s.seq.block_table, s.seq.token_ids, s.seq.num_computed)
        if s.samples:
            s.seq.append(next_token)
            if len(s.seq.output_ids) >= s.seq.params.max_tokens:
                scheduler.finish(s.seq)


def live_tables(seqs):
    return [s.block_table for s in seqs if not s.is_finished]


def test_a_step_respects_the_token_budget_and_splits_long_prompts():
    sched = make_scheduler(max_num_batched_tokens=16)
    long_seq = make_seq(0, 40)
    sched.add(long_seq)
    chunks = []
    while long_seq.num_computed < 40:
        plan = sched.schedule()
        assert plan.num_batched_tokens <= 16
        chunks.append((plan.scheduled[0].num_tokens, plan.scheduled[0].samples))
        run_step(sched, plan)
    assert chunks == [(16, False), (16, False), (8, True)]  # only the last chunk samples


def test_decodes_go_first_and_prompt_chunks_fill_the_rest():
    sched = make_scheduler(max_num_batched_tokens=16)
    a, b = make_seq(0, 3), make_seq(1, 3)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())  # both prompts in one step
    late = make_seq(2, 30)
    sched.add(late)
    plan = sched.schedule()
    sizes = {s.seq.seq_id: s.num_tokens for s in plan.scheduled}
    assert sizes == {0: 1, 1: 1, 2: 14}  # decoding sequences are never stalled by a long prompt


def test_running_sequences_are_capped():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    for i in range(4):
        sched.add(make_seq(i, 2))
    plan = sched.schedule()
    assert [s.seq.seq_id for s in plan.scheduled] == [0, 1] and len(sched.waiting) == 2


def test_out_of_blocks_preempts_the_newest_which_later_resumes_without_losing_tokens():
    # 6 blocks of 4 slots: three sequences of 8 tokens fit, but not once they grow (all three
    # admitted at once, as vLLM admits: conservativeness 0 keeps no room for their growth).
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=32, schedule_conservativeness=0)
    seqs = [make_seq(i, 7, max_tokens=6) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_step(sched, sched.schedule(), next_token=11)  # prompts: 7 tokens each
    run_step(sched, sched.schedule(), next_token=11)  # 8 computed: two full blocks each, none left
    plan = sched.schedule()  # each needs a 3rd block for its 9th token: only the oldest two can have one
    assert plan.preempted == [seqs[2]] and seqs[2].status is SequenceStatus.WAITING
    assert [s.seq for s in plan.scheduled] == seqs[:2]
    assert seqs[2].output_ids == [11, 11] and seqs[2].num_computed == 0 and sched.waiting[0] is seqs[2]
    sched.blocks.check_invariants(live_tables(seqs))
    for _ in range(40):
        if not sched.has_work():
            break
        run_step(sched, sched.schedule(), next_token=12)
        sched.blocks.check_invariants(live_tables(seqs))
    assert all(s.is_finished for s in seqs)
    assert seqs[2].output_ids == [11, 11] + [12] * 4  # its first tokens were kept, not emitted again
    assert sched.blocks.num_free_blocks == 6


def test_a_preempted_sequence_recomputes_prompt_and_output():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=32, schedule_conservativeness=0)
    old, new = make_seq(0, 7, max_tokens=9), make_seq(1, 7, max_tokens=9)  # 16 tokens: the whole pool
    sched.add(old)
    sched.add(new)
    run_step(sched, sched.schedule(), next_token=5)
    run_step(sched, sched.schedule(), next_token=5)
    plan = sched.schedule()
    assert plan.preempted == [new]
    while not old.is_finished:
        run_step(sched, sched.schedule())
    plan = sched.schedule()
    (resumed,) = plan.scheduled
    assert resumed.seq is new and resumed.context_len + resumed.num_tokens == 9  # prompt + its 2 kept tokens
    assert resumed.samples


def test_waiting_requests_are_served_first_come_first_served():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=32)
    big, small = make_seq(0, 15), make_seq(1, 2)
    blocker = make_seq(2, 4)
    sched.add(blocker)
    run_step(sched, sched.schedule())  # blocker holds 2 blocks (4 prompt tokens + 1 output)
    sched.add(big)
    sched.add(small)
    plan = sched.schedule()
    assert [s.seq for s in plan.scheduled] == [blocker]  # big does not fit yet, and small may not overtake it


def test_later_samples_wait_until_sample_zero_has_cached_the_prompt():
    sched = make_scheduler(max_num_batched_tokens=8)
    first = make_seq(0, 12)
    second = make_seq(1, 0, waits_for=first, prefix=first.prompt_ids)  # sample 1 of the same prompt
    sched.add(first)
    sched.add(second)
    plan = sched.schedule()
    assert [s.seq for s in plan.scheduled] == [first]
    run_step(sched, plan)
    assert not second.ready
    run_step(sched, sched.schedule())  # the rest of the prompt
    assert second.ready
    plan = sched.schedule()
    shared = next(s for s in plan.scheduled if s.seq is second)
    assert shared.context_len == 8  # two full blocks from the prefix cache; the tail block is its own


@pytest.mark.parametrize("conservativeness", [0.0, 1.0])
@pytest.mark.parametrize("seed", range(20))
def test_random_lifecycles_never_leak_blocks(seed, conservativeness):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=rng.randint(8, 20), max_num_batched_tokens=rng.choice([8, 16, 32]),
                           max_num_seqs=rng.choice([2, 4, 8]), schedule_conservativeness=conservativeness)
    seqs: list[Sequence] = []
    for step in range(300):
        if rng.random() < 0.3 and len(seqs) < 40:
            length, max_tokens = rng.randint(1, 20), rng.randint(1, 12)
            prefix = None
            if rng.random() < 0.3 and seqs:  # a shared prefix
                prefix = seqs[-1].prompt_ids[: rng.randint(1, len(seqs[-1].prompt_ids))]
            seq = make_seq(len(seqs), length, max_tokens=max_tokens, prefix=prefix)
            longest = seq.num_tokens + seq.params.max_tokens
            if sched.blocks.blocks_needed(seq.block_table, longest) <= sched.blocks.num_blocks:
                seqs.append(seq)  # (the engine rejects a request that could never fit)
                sched.add(seq)
        live = [s for s in seqs if not s.is_finished]
        if live and rng.random() < 0.1:  # abort anything, running or waiting
            sched.finish(rng.choice(live))
        plan = sched.schedule()
        assert plan.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        run_step(sched, plan, next_token=rng.randint(1, 50))
        sched.blocks.check_invariants(live_tables(seqs))
        if not sched.has_work() and step > 200:
            break
    for _ in range(2000):
        if not sched.has_work():
            break
        run_step(sched, sched.schedule())
    sched.blocks.check_invariants([])
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_admission_keeps_room_for_what_running_sequences_may_still_emit():
    # 16 blocks of 4 slots. `running` may emit 39 more tokens: a newcomer whose prompt alone fits
    # waits while the share of those tokens the scheduler expects (0.7 at first) would not fit
    # beside it; admitted as vLLM admits (conservativeness 0), it would start at once.
    for conservativeness, starts in ((1.0, False), (0.0, True)):
        sched = make_scheduler(num_blocks=16, max_num_batched_tokens=32, schedule_conservativeness=conservativeness)
        running = make_seq(0, 4, max_tokens=40)
        sched.add(running)
        run_step(sched, sched.schedule())
        newcomer = make_seq(1, 24, max_tokens=40)
        sched.add(newcomer)
        plan = sched.schedule()
        assert (newcomer in [s.seq for s in plan.scheduled]) is starts
    sched.finish(running)  # once the room is there, it starts
    assert [s.seq for s in sched.schedule().scheduled] == [newcomer]


def test_a_reply_counts_as_long_as_the_longest_recent_ones_that_ended_by_themselves():
    """A chat completion without max_tokens may run to the context's end; most end far sooner.
    Before any reply has ended by itself a running one counts as up to 4096 tokens (SGLang's
    bound); once replies have ended on EOS after a token, one with room for 200 counts as only a
    little longer. Replies cut short by their own max_tokens say nothing of that."""
    def newcomer_starts(earlier: list[Sequence]) -> bool:
        sched = make_scheduler(num_blocks=64, max_num_batched_tokens=32)
        run_until_done(sched, earlier)
        running = make_seq(0, 4, max_tokens=200)
        sched.add(running)
        run_step(sched, sched.schedule())
        newcomer = make_seq(1, 4, max_tokens=200)
        sched.add(newcomer)
        return newcomer in [s.seq for s in sched.schedule().scheduled]

    def ending_on_eos(seq_id: int) -> Sequence:
        seq = make_seq(seq_id, 4, max_tokens=200)
        seq.stop_ids = frozenset({99})  # the token every step of `run_step` samples
        return seq

    assert not newcomer_starts([])
    assert not newcomer_starts([make_seq(10 + i, 4, max_tokens=10) for i in range(3)])  # "length"
    assert newcomer_starts([ending_on_eos(10 + i) for i in range(3)])


def run_until_done(sched: Scheduler, seqs: list[Sequence]) -> int:
    """All of `seqs` submitted at once, stepped to completion; the prompt and output tokens computed."""
    for seq in seqs:
        sched.add(seq)
    computed = 0
    for _ in range(5000):
        if not sched.has_work():
            break
        plan = sched.schedule()
        computed += sum(s.num_tokens for s in plan.scheduled)
        run_step(sched, plan)
    assert all(s.is_finished for s in seqs)
    return computed


def test_a_full_pool_preempts_and_recomputes_far_less_than_admitting_on_the_first_chunk():
    """Sixteen requests of 10 + 30 tokens where the pool holds about two and a half: admitted on
    their first chunk (vLLM's way), the newest are preempted again and again as the others grow."""
    totals = {}
    for conservativeness in (0.0, 1.0):
        sched = make_scheduler(num_blocks=24, max_num_batched_tokens=32, schedule_conservativeness=conservativeness)
        seqs = [make_seq(i, 10, max_tokens=30) for i in range(16)]
        totals[conservativeness] = (run_until_done(sched, seqs), sched.num_preemptions)
        assert [s.output_ids for s in seqs] == [[99] * 30] * 16
        assert sched.blocks.num_free_blocks == 24
    (computed_vllm, preempted_vllm), (computed, preempted) = totals[0.0], totals[1.0]
    assert preempted < preempted_vllm / 2
    needed = 16 * 40  # every prompt and output token once; the rest is recomputation
    assert computed - needed < (computed_vllm - needed) / 4


def test_the_expected_share_decays_while_nobody_is_preempted_and_rises_when_someone_is():
    ratio = NewTokenRatio(1.0)
    assert ratio.value == INITIAL_RATIO
    for _ in range(DECAY_STEPS):
        ratio.step()
    assert ratio.value == pytest.approx(INITIAL_RATIO * MIN_RATIO_FACTOR)
    nearly_done = make_seq(0, 4, max_tokens=100)
    nearly_done.output_ids = [1] * 60  # survivors that used most of their max_tokens: expect as much
    ratio.preempted([nearly_done])
    assert ratio.value == pytest.approx((60 + RESUME_STEPS) / 101)
    ratio.preempted([make_seq(1, 4, max_tokens=100)])  # never below what it was, nor below the start
    assert ratio.value == pytest.approx((60 + RESUME_STEPS) / 101)
    assert NewTokenRatio(2.0).value == 1.0 and not NewTokenRatio(0.0).reserves


def test_a_sequence_that_can_never_fit_raises_instead_of_spinning():
    sched = make_scheduler(num_blocks=2, max_num_batched_tokens=16)
    seq = make_seq(0, 7, max_tokens=8)
    sched.add(seq)
    with pytest.raises(RuntimeError, match="more KV blocks than the whole pool"):
        for _ in range(10):
            run_step(sched, sched.schedule())


def test_a_step_s_shape_counts_decodes_as_the_policy_plans_them():
    """The shape a step is planned with is the one its record reports: a running sequence's next
    token is a decode; a newly admitted one-token prompt is a prompt chunk, however short."""
    sched = make_scheduler()
    decoding = make_seq(0, 3)
    sched.add(decoding)
    run_step(sched, sched.schedule())  # prefilled; its first token sampled
    sched.add(make_seq(1, 1))  # a one-token prompt arrives
    plan = sched.schedule()
    assert sorted(s.num_tokens for s in plan.scheduled) == [1, 1]
    assert (plan.shape.decodes, plan.shape.tokens) == (1, 2)
    assert plan.shape.keys == decoding.num_tokens  # one decode, reading its whole sequence
