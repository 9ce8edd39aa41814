"""Per-sequence state: tokens, how many are in the KV cache, sampling state, output text.

A request with `n` samples becomes `n` sequences. Sample 0 computes the prompt; the others
wait until it is cached and then find it in the prefix cache, so the prompt's blocks are
shared and computed once.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from drafters.base import Drafter
from specserve.block_manager import BlockTable
from specserve.detokenizer import TextStream
from specserve.sampling import SamplingParams, SamplingRow


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives at that step."""

    token_id: int
    logprob: float
    top_logprobs: dict[int, float]


@dataclass
class SpecStats:
    """Speculation counters of one sequence (summed over samples in a request's metrics)."""

    target_forwards: int = 0  # every target forward the sequence took part in: prompt chunks, decodes, trees
    verify_steps: int = 0  # target forwards that verified a drafted tree
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # drafted tokens the target accepted (bonus tokens not counted)
    accepted_at_depth: list[int] = field(default_factory=list)  # [d]: steps that accepted >= d + 1 tokens
    # Verify steps that ended in a rejected token, not at the tree's edge: a chain of two fully
    # accepted tells nothing of the third token (what the speculation policy's estimate needs).
    rejections: int = 0

    def record(self, drafted: int, accepted: int, rejected: bool = True) -> None:
        self.verify_steps += 1
        self.rejections += rejected
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        if accepted > len(self.accepted_at_depth):
            self.accepted_at_depth += [0] * (accepted - len(self.accepted_at_depth))
        for depth in range(accepted):
            self.accepted_at_depth[depth] += 1

    def add(self, other: SpecStats) -> None:
        self.target_forwards += other.target_forwards
        self.verify_steps += other.verify_steps
        self.rejections += other.rejections
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        for depth, count in enumerate(other.accepted_at_depth):
            if depth == len(self.accepted_at_depth):
                self.accepted_at_depth.append(0)
            self.accepted_at_depth[depth] += count

    @property
    def mean_accepted_tokens(self) -> float | None:
        """MAT: tokens emitted per verifying target forward (accepted + the bonus token)."""
        return None if not self.verify_steps else (self.accepted_tokens + self.verify_steps) / self.verify_steps


@dataclass(eq=False)
class Sequence:
    seq_id: int  # engine-wide and increasing: arrival order, so preemption picks the largest
    request_id: str
    index: int  # which of the request's n samples
    prompt_ids: list[int]
    params: SamplingParams
    text: TextStream
    generator: torch.Generator | None = None
    stop_ids: frozenset[int] = frozenset()  # stop_token_ids plus EOS (unless ignore_eos)
    waits_for: Sequence | None = None  # sample 0 of the same request, until its prompt is cached
    token_ids: list[int] = field(init=False)  # prompt + output
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # leading token_ids whose K/V are in the cache
    block_table: BlockTable = field(default_factory=BlockTable)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    # metrics
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache instead of computed
    num_forwarded_tokens: int = 0  # tokens this sequence put through the model (recomputation included)
    num_preemptions: int = 0
    # speculation, decided when the request is added
    drafter: Drafter | None = None
    max_tree_tokens: int = 0
    spec_stats: SpecStats = field(default_factory=SpecStats)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to put through the model before this sequence can sample again."""
        return self.num_tokens - self.num_computed

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens this sequence may still emit before max_tokens."""
        return self.params.max_tokens - len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def ready(self) -> bool:
        """May be admitted: sample 0 of its request has its prompt in the cache (or is gone)."""
        w = self.waits_for
        return w is None or w.is_finished or w.num_computed >= len(w.prompt_ids)

    def sampling_row(self) -> SamplingRow:
        return SamplingRow(self.params, self.prompt_ids, self.output_ids, self.generator)

    def append(self, token: int) -> str:
        """Record a sampled token; return the text it releases. Sets finish_reason when done."""
        self.token_ids.append(token)
        self.output_ids.append(token)
        self.first_token_time = self.first_token_time or time.perf_counter()
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return self.text.flush()
        delta, stopped = self.text.push(token)
        if stopped:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
            delta += self.text.flush()
        return delta
