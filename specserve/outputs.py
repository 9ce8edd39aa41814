"""What the engine returns: vLLM-shaped request and completion outputs (names scripts rely on)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.sequence import Sequence, SpecStats, TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error", or None while running
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    delta_text: str = ""  # what the latest step added (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_cached_tokens: int  # prompt tokens taken from the prefix cache (sample 0)
    num_computed_tokens: int  # tokens put through the model for this request, all samples
    num_preemptions: int
    spec: SpecStats = field(default_factory=SpecStats)  # speculation, all samples together

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Why the engine failed this request alone (finish_reason "error"), the step going on for the others.
    error: str | None = None


def completion_output(seq: Sequence, delta_text: str = "",
                      delta_token_ids: list[int] | None = None) -> CompletionOutput:
    return CompletionOutput(
        index=seq.index,
        text=seq.text.text,
        token_ids=list(seq.output_ids),
        finish_reason=seq.finish_reason,
        logprobs=None if seq.logprobs is None else list(seq.logprobs),
        cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
        delta_text=delta_text,
        delta_token_ids=delta_token_ids or [],
    )


def request_metrics(seqs: list[Sequence]) -> RequestMetrics:
    firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
    finishes = [s.finish_time for s in seqs]
    return RequestMetrics(
        arrival_time=seqs[0].arrival_time,
        first_token_time=min(firsts) if firsts else None,
        finish_time=None if None in finishes else max(finishes),
        num_cached_tokens=seqs[0].num_cached_tokens,
        num_computed_tokens=sum(s.num_forwarded_tokens for s in seqs),
        num_preemptions=sum(s.num_preemptions for s in seqs),
        spec=_total_spec(seqs),
    )


def _total_spec(seqs: list[Sequence]) -> SpecStats:
    total = SpecStats()
    for seq in seqs:
        total.add(seq.spec_stats)
    return total
