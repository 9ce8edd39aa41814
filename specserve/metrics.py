"""The server's `/metrics`: Prometheus text format, names as vLLM's with a `specserve:` prefix
(`specserve:num_requests_running`, `specserve:time_to_first_token_seconds`,
`specserve:spec_decode_num_accepted_tokens_per_pos`, ...), so vLLM dashboards carry over.

Request latencies are observed when a request ends, by the engine's thread (the only writer);
engine state (running and waiting requests, KV blocks in use, speculation totals) is read when
scraped, from the server's event loop while that thread runs: figures may be a step apart.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from specserve.engine import LLMEngine
from specserve.outputs import RequestOutput

PREFIX = "specserve:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative), then +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += count
            out.append(f'{name}_bucket{{le="{"+Inf" if bound == float("inf") else bound}"}} {running}')
        return [*out, f"{name}_sum {self.total}", f"{name}_count {running}"]


@dataclass
class ServerMetrics:
    finished: Counter = field(default_factory=Counter)  # by finish reason ("stop", "length", "abort")
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found there
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    rejected: Counter = field(default_factory=Counter)  # requests refused before the engine, by reason

    def observe(self, out: RequestOutput) -> None:
        """A request that ended (finished, or aborted with what it had)."""
        m = out.metrics
        for c in out.outputs:
            self.finished[c.finish_reason or "abort"] += 1
            self.generation_tokens += len(c.token_ids)
        self.prompt_tokens += len(out.prompt_token_ids)
        self.prefix_cache_queries += len(out.prompt_token_ids)
        self.prefix_cache_hits += m.num_cached_tokens
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            tokens = max(len(c.token_ids) for c in out.outputs)
            if m.finish_time is not None and tokens > 1:
                self.tpot.observe((m.finish_time - m.first_token_time) / (tokens - 1))
        if m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)

    def render(self, engine: LLMEngine) -> str:
        """The exposition, engine state read now."""
        scheduler, blocks, spec = engine.scheduler, engine.block_manager, engine.metrics.spec
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[str] | float) -> None:
            full = PREFIX + name
            lines.extend([f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"])
            if isinstance(samples, list):
                lines.extend(f"{full}{sample}" for sample in samples)
            else:
                lines.append(f"{full} {samples}")

        escape = lambda v: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")  # noqa: E731
        labels = ",".join(f'{key}="{escape(value)}"' for key, value in engine.info.items())
        metric("engine_info", "gauge", "What the engine runs: CPU, dtype, weight format, kernels, default drafter, "
               "KV cache dtype.",
               [f"{{{labels}}} 1"])
        metric("num_requests_running", "gauge", "Sequences running in the engine.", len(scheduler.running))
        metric("num_requests_waiting", "gauge", "Sequences waiting to run.", len(scheduler.waiting))
        metric("num_preemptions_total", "counter", "Sequences preempted for KV blocks (recomputed later).",
               scheduler.num_preemptions)
        metric("kv_cache_usage_perc", "gauge", "Share of KV blocks held by requests (1 = all).",
               1.0 - blocks.num_free_blocks / blocks.num_blocks)
        metric("kv_cache_blocks", "gauge", "KV blocks in the pool.", blocks.num_blocks)
        metric("kv_cache_bytes_per_token", "gauge", "Pool bytes a token takes (the target's K/V in the pool's "
               "dtype, scales included, and drafters' own).", engine.kv_bytes_per_block // engine.config.block_size)
        metric("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.",
               self.prefix_cache_queries)
        metric("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.", self.prefix_cache_hits)
        metric("request_success_total", "counter", "Completions that ended, by finish reason.",
               [f'{{finished_reason="{reason}"}} {count}' for reason, count in sorted(self.finished.items())])
        metric("request_failure_total", "counter", "Requests the engine failed alone (their sampling, drafting or "
               "detokenizing raised); the others went on.", engine.metrics.failed_requests)
        metric("drafter_errors_total", "counter", "Drafter calls that raised (their sequences went without "
               "speculation for that step).", engine.metrics.drafter_errors)
        metric("request_rejected_total", "counter", "Requests refused before reaching the engine, by reason.",
               [f'{{reason="{reason}"}} {count}' for reason, count in sorted(self.rejected.items())])
        metric("prompt_tokens_total", "counter", "Prompt tokens of ended requests.", self.prompt_tokens)
        metric("generation_tokens_total", "counter", "Tokens generated by ended requests.", self.generation_tokens)
        for name, histogram, help_text in (
            ("time_to_first_token_seconds", self.ttft, "Time to first token."),
            ("time_per_output_token_seconds", self.tpot, "Time per output token after the first."),
            ("e2e_request_latency_seconds", self.e2e, "Request latency, arrival to end."),
        ):
            lines.extend([f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} histogram"])
            lines.extend(histogram.lines(PREFIX + name))
        metric("spec_decode_num_drafts", "counter", "Target forwards that verified a drafted tree.", spec.verify_steps)
        metric("spec_decode_num_draft_tokens", "counter", "Drafted tokens verified.", spec.drafted_tokens)
        metric("spec_decode_num_accepted_tokens", "counter", "Drafted tokens accepted.", spec.accepted_tokens)
        metric("spec_decode_num_accepted_tokens_per_pos", "counter",
               "Verifications that accepted at least position + 1 drafted tokens.",
               [f'{{position="{d}"}} {count}' for d, count in enumerate(spec.accepted_at_depth)])
        gauges: dict[str, list[str]] = {}
        for (drafter, name), value in sorted(engine.drafter_gauges().items()):
            gauges.setdefault(name, []).append(f'{{drafter="{escape(drafter)}"}} {value}')
        for name, samples in gauges.items():
            metric(f"drafter_{name}", "gauge", "What a loaded drafter holds now (memory it bounds).", samples)
        return "\n".join(lines) + "\n"
