"""Continuous batching: which sequences run this step, with how many tokens each.

Every step is one flat batch under `max_num_batched_tokens` and `max_num_seqs` (Orca's
iteration-level scheduling). Decoding sequences are served first (one token each), then
prompt chunks fill the remaining budget (Sarathi/SplitFuse chunked prefill), so a long
prompt never stalls the others. A waiting sequence starts only where the free pool also keeps
room for the running sequences' expected growth (`specserve.admission`). When the KV pool runs
out all the same, the newest running sequence is preempted: its blocks are freed and it is
recomputed later from its prompt plus the tokens it already emitted (those are kept, never
emitted again; the prefix cache usually spares most of the recomputation).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.admission import NewTokenRatio
from specserve.block_manager import BlockManager, BlockTable, NoFreeBlocks
from specserve.config import EngineConfig
from specserve.cost_model import decode_keys
from specserve.sequence import Sequence, SequenceStatus
from specserve.speculation import FixedPolicy, SpeculationPolicy, StepShape, TreePlan
from specserve.tree import TokenTree


@dataclass
class ScheduledSequence:
    """One sequence's part of a step: the next `num_tokens` of its tokens, after `context_len`."""

    seq: Sequence
    context_len: int
    num_tokens: int
    tree_budget: int = 0  # speculative nodes a drafter may add beyond these tokens (the speculative engine)
    decode: bool = False  # a running sequence's next token (not a prompt chunk, however short)

    @property
    def samples(self) -> bool:
        """This chunk reaches the sequence's last token, so its logits give the next token."""
        return self.context_len + self.num_tokens == self.seq.num_tokens

    def tree(self) -> TokenTree:
        return TokenTree.chain(self.seq.token_ids[self.context_len : self.context_len + self.num_tokens])


def step_shape(scheduled: list[ScheduledSequence]) -> StepShape:
    """A step's shape by the same rules the policy planned it with: decodes are running
    sequences' next tokens; prompt chunks, admitted ones included, count as tokens."""
    decodes = [s for s in scheduled if s.decode]
    return StepShape(len(decodes), sum(s.num_tokens for s in scheduled),
                     decode_keys([s.seq.num_tokens for s in decodes]))


@dataclass
class StepPlan:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    token_seconds: float | None = None  # seconds per emitted token the speculation policy expects
    shape: StepShape = StepShape(0, 0)  # of the step as scheduled (`step_shape`): what its record reports

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens + s.tree_budget for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, policy: SpeculationPolicy | None = None):
        self.config = config
        self.blocks = block_manager
        self.policy = policy or FixedPolicy()  # tree budgets: see specserve.speculation
        self.waiting: deque[Sequence] = deque()  # oldest first; preempted sequences go back to the front
        self.running: list[Sequence] = []  # in arrival (seq_id) order
        self.new_token_ratio = NewTokenRatio(config.schedule_conservativeness)
        self.num_preemptions = 0  # since start

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED
        self.new_token_ratio.ended(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self.new_token_ratio.step()
        budget = self.config.max_num_batched_tokens
        wanted: dict[Sequence, int] = {}
        # Decodes first, then their drafted trees, then prompt chunks (oldest first) from what is left.
        for seq in self.running:
            if seq.num_uncomputed == 1:
                wanted[seq] = 1
                budget -= 1
        prompt_tokens = min(budget, sum(s.num_uncomputed for s in self.running if s.num_uncomputed > 1))
        caps = {seq: self._cap(seq) for seq in wanted if seq.drafter is not None}
        shape = StepShape(len(wanted), len(wanted) + prompt_tokens, decode_keys([seq.num_tokens for seq in wanted]))
        tree_plan = self.policy.plan(caps, shape, budget) if caps else TreePlan({})
        tree_budgets, plan.token_seconds = tree_plan.tree_budgets, tree_plan.token_seconds
        budget -= sum(tree_budgets.values())
        for seq in self.running:
            if seq.num_uncomputed > 1 and budget > 0:
                wanted[seq] = min(seq.num_uncomputed, budget)
                budget -= wanted[seq]

        # Blocks, oldest first: running out preempts the newest running sequence, which is never
        # one already planned (those are older), so the plan needs no pruning afterwards.
        for seq in list(self.running):
            if seq not in wanted or seq.status is not SequenceStatus.RUNNING:
                continue
            if self._reserve(seq, wanted[seq], plan):
                plan.scheduled.append(ScheduledSequence(seq, seq.num_computed, wanted[seq],
                                                        decode=seq.num_uncomputed == 1))
        for s in plan.scheduled:  # trees only from blocks nobody's next token needs
            s.tree_budget = self._reserve_tree(s.seq, tree_budgets.get(s.seq, 0))
        budget = self.config.max_num_batched_tokens - plan.num_batched_tokens  # what preemption freed

        if not plan.preempted:  # under memory pressure, admit nobody new
            self._admit(plan, budget)
        plan.shape = step_shape(plan.scheduled)
        return plan

    def _cap(self, seq: Sequence) -> int:
        """The most drafted nodes this sequence may verify this step: its `max_tree_tokens`, and no deeper than the
        tokens it may still emit (the bonus token always comes on top)."""
        return max(0, min(seq.max_tree_tokens, seq.num_remaining_tokens - 1))

    def _reserve_tree(self, seq: Sequence, tree_budget: int) -> int:
        """Slots for a drafted tree if the pool has them now; speculation never preempts anyone."""
        if tree_budget:
            try:
                self.blocks.ensure_slots(seq.block_table, seq.num_computed + 1 + tree_budget)
            except NoFreeBlocks:
                return 0
        return tree_budget

    def _reserve(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        """Blocks for `seq`'s next tokens, preempting newer sequences; False if `seq` itself was preempted."""
        while True:
            try:
                self.blocks.ensure_slots(seq.block_table, seq.num_computed + num_tokens)
                return True
            except NoFreeBlocks:
                if self.running == [seq]:  # alone and still short: waiting would never help
                    raise RuntimeError(f"sequence {seq.request_id!r} needs more KV blocks than the whole pool "
                                       f"({self.blocks.num_blocks}); the engine rejects such requests") from None
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.block_table = BlockTable()
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)  # newest preempted first, so the oldest ends up in front
        self.num_preemptions += 1
        self.new_token_ratio.preempted(self.running)

    def _admit(self, plan: StepPlan, budget: int) -> None:
        """Start waiting sequences in arrival order while budget, sequence slots and blocks last,
        blocks for the running sequences' expected growth included (`specserve.admission`)."""
        if not self.waiting:
            return
        growth = self._expected_growth()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if not seq.ready:  # a later sample of a request whose prompt is still being computed
                continue
            table = self.blocks.allocate(seq.token_ids)
            context_len = table.num_cached_tokens
            num_tokens = min(seq.num_tokens - context_len, budget)
            needs = self.new_token_ratio.unreserved(seq, table.num_slots(self.blocks.block_size))
            if growth is not None and self.running and growth + needs > self._free_slots():
                self.blocks.free(table)
                return  # first come, first served (below): nobody overtakes the head of the queue
            try:
                self.blocks.ensure_slots(table, context_len + num_tokens)
            except NoFreeBlocks:
                self.blocks.free(table)
                return  # first come, first served: nobody overtakes the head of the queue
            self.waiting.remove(seq)
            seq.block_table, seq.num_computed = table, context_len
            if not seq.num_preemptions:
                seq.num_cached_tokens = min(context_len, len(seq.prompt_ids))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.running.sort(key=lambda s: s.seq_id)  # a resumed sequence is older than newer admissions
            plan.scheduled.append(ScheduledSequence(seq, context_len, num_tokens))
            budget -= num_tokens
            if growth is not None:  # what it may still need beyond the blocks it now holds
                growth += self.new_token_ratio.unreserved(seq, table.num_slots(self.blocks.block_size))

    def _expected_growth(self) -> float | None:
        """Pool slots the running sequences are expected to take beyond their blocks (None: admission
        keeps no room for them, `schedule_conservativeness` 0)."""
        if not self.new_token_ratio.reserves:
            return None
        size = self.blocks.block_size
        return sum(self.new_token_ratio.unreserved(s, s.block_table.num_slots(size)) for s in self.running)

    def _free_slots(self) -> int:
        return self.blocks.num_free_blocks * self.blocks.block_size
