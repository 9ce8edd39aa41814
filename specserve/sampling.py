"""Sampling parameters and the sampler: from a step's logits to each request's next token.

The processed distribution is defined once here, because lossless speculative verification
must sample from exactly the distribution plain decoding samples from. Order, per row:

1. repetition penalty over prompt + output tokens (divide positive logits, multiply negative);
2. presence and frequency penalties over output tokens (OpenAI semantics);
3. temperature (0 means greedy: the argmax of the penalised logits);
4. top-k, then top-p (smallest set whose probability reaches p), then min-p (tokens whose
   probability is at least min_p times the most likely token's) -- each removes tokens.

Seeded requests draw from their own generator, so their output does not depend on what else
is in the batch.

Every distribution computed here is finite for every parameter value `SamplingParams` admits:
temperatures below `GREEDY_BELOW_TEMPERATURE` are greedy (as vLLM treats them; dividing by them
overflows float32), penalties are bounded, and every filter keeps the most likely token. What
still comes out non-finite (logits that are NaN or infinite) raises `SamplingError`, which
fails that one request, never the step.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from functools import cache

import torch

TREE_SHAPES = ("chain", "tree", "dynamic")
# Below this a temperature means greedy: vLLM's _SAMPLING_EPS. Logits divided by a smaller one
# overflow float32 (1e-39 is already subnormal), and their softmax is NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
# repetition_penalty divides or multiplies logits: within these bounds every result stays finite.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# A torch generator's seed is 64 bits: OpenAI's signed seeds and unsigned ones both fit.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # the engine keeps them per request and scans every token
MAX_DRAFTER_SPEC_CHARS = 256  # speculation.drafter: a spec, never a document
INT64_MAX = 2**63 - 1  # what a request's unbounded integers are clamped to where they meet int64 tensors


class SamplingError(ValueError):
    """A request's sampling distribution could not be formed (non-finite logits): that request fails."""


@dataclass
class SpeculationParams:
    """A request's say in speculation (the server's `speculation` field has the same keys)."""

    enabled: bool = True
    drafter: str | None = None  # a drafter spec string (see `drafters.spec`); None: the engine's drafter
    max_tree_tokens: int | None = None  # drafted nodes per step at most; None: the engine's setting
    # How model drafters grow the tree (n-gram lookup proposes what it finds, within the depth):
    # "chain" one guess per depth; "tree" every node's top_k children, depth by depth, until the
    # budget is spent; "dynamic" (EAGLE-2) the likeliest nodes by cumulative draft probability.
    # None: the engine's ("dynamic" with --draft-top-k / --draft-beam).
    tree: str | None = None
    top_k: int | None = None  # children per expanded node ("tree", "dynamic"); None: the engine's
    max_depth: int | None = None  # drafted tokens on a root-to-leaf path at most; None: the budget
    # False: this request's output is not kept for drafting other requests' (the `suffix` drafter's
    # cross-request cache); it still drafts from what others shared.
    share_output: bool = True

    def __post_init__(self) -> None:
        if self.drafter is not None:
            if not isinstance(self.drafter, str) or len(self.drafter) > MAX_DRAFTER_SPEC_CHARS:
                raise ValueError(f"speculation.drafter must be a drafter spec of at most {MAX_DRAFTER_SPEC_CHARS} "
                                 f"characters, like 'ngram' or 'early-exit:6'")
            self.drafter = normalized_drafter_spec(self.drafter)
        if self.max_tree_tokens is not None and self.max_tree_tokens < 0:
            raise ValueError(f"speculation.max_tree_tokens must be >= 0, got {self.max_tree_tokens}")
        if self.tree is not None and self.tree not in TREE_SHAPES:
            raise ValueError(f"speculation.tree {self.tree!r}: use one of {', '.join(TREE_SHAPES)}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"speculation.top_k must be >= 1, got {self.top_k}")
        if self.max_depth is not None and self.max_depth < 1:
            raise ValueError(f"speculation.max_depth must be >= 1, got {self.max_depth}")
        if not isinstance(self.share_output, bool):
            raise ValueError(f"speculation.share_output must be true or false, got {self.share_output!r}")

    @classmethod
    def coerce(cls, value: SpeculationParams | dict | None) -> SpeculationParams | None:
        if value is None or isinstance(value, cls):
            return value
        keys = ", ".join(f.name for f in fields(cls))
        if not isinstance(value, dict):
            raise ValueError(f"speculation must be an object like {{'enabled': true, 'drafter': 'ngram', "
                             f"'max_tree_tokens': 8}} (keys: {keys}), got {value!r}")
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"speculation has unknown keys {sorted(unknown)}: use {keys}")
        return cls(**value)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) keeps every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top alternatives to return with each token's logprob
    speculation: SpeculationParams | dict | None = None  # None: the engine's drafter and tree budget

    def __post_init__(self) -> None:
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (0 <= self.temperature < float("inf"), f"temperature must be >= 0 and finite, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (all tokens) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] "
             f"(1 means none), got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.seed is None or MIN_SEED <= self.seed <= MAX_SEED,
             f"seed must be in [-2**63, 2**64 - 1], got {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.speculation = SpeculationParams.coerce(self.speculation)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                             f"characters each")
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            self.temperature = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the raw logits: nothing to compute per row."""
        return self.greedy and not self.needs_penalties

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def normalized_drafter_spec(spec: str) -> str:
    """One spelling per drafter spec ("NGram " and "ngram" are the same drafter, cached once).
    Raises ValueError, saying what to write, for a spec that does not parse."""
    from drafters.spec import parse_spec  # drafters import the engine's types; import on use

    parts = parse_spec(spec)
    return "+".join(str(p) for p in parts) if parts else "none"


@dataclass
class SamplingRow:
    """One row of logits to sample from: its parameters, token history and generator."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: torch.Generator | None = None


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Repetition, presence and frequency penalties on one row of logits (returns a new tensor)."""
    return penalize(logits[None], [row])[0]


def penalize(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """`apply_penalties` for every row of `scores` ([R, vocab]) at once, each with its own
    parameters and history; rows without penalties are left as they are (returns a new tensor).
    The index lists are built on the host from the histories: no read from the device."""
    scores = scores.clone()
    repeat: list[tuple[int, int, float]] = []  # row, token, penalty
    counted: list[tuple[int, int, int, float, float]] = []  # row, token, count, frequency, presence
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1:
            repeat += [(i, t, p.repetition_penalty) for t in sorted(set(row.prompt_ids) | set(row.output_ids))]
        if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
            counted += [(i, t, n, p.frequency_penalty, p.presence_penalty) for t, n in Counter(row.output_ids).items()]
    if repeat:
        row_of, token, penalties = zip(*repeat, strict=True)
        at = _indices(scores, row_of, token)
        penalty = torch.tensor(penalties, dtype=scores.dtype, device=scores.device)
        values = scores[at]
        scores[at] = torch.where(values > 0, values / penalty, values * penalty)
    if counted:
        row_of, token, *amounts = zip(*counted, strict=True)
        count, frequency, presence = (torch.tensor(a, dtype=scores.dtype, device=scores.device) for a in amounts)
        scores[_indices(scores, row_of, token)] -= frequency * count + presence
    return scores


def _indices(scores: torch.Tensor, rows: Sequence[int], columns: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows, dtype=torch.int64, device=scores.device),
            torch.tensor(columns, dtype=torch.int64, device=scores.device))


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p: excluded tokens get -inf (returns a new tensor)."""
    return filter_rows(logits[None], [params])[0]


def filter_rows(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`filter_logits` for every row of `scores` ([R, vocab], none greedy) with its own parameters;
    each filter runs on the rows that ask for it alone (a sort of the vocabulary is dear)."""
    scores = scores / _column(scores, [p.temperature for p in params])
    vocab = scores.shape[-1]
    top_k = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if top_k:
        def keep_top_k(rows: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
            ks = [p.top_k for p in ps]
            kth = torch.topk(rows, max(ks), dim=-1).values.gather(1, _column(rows, [k - 1 for k in ks], torch.int64))
            return rows.masked_fill(rows < kth, float("-inf"))

        scores = _on_rows(scores, top_k, params, keep_top_k)
    if top_p := [i for i, p in enumerate(params) if p.top_p < 1]:
        def keep_top_p(rows: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
            sorted_rows = torch.sort(rows, dim=-1, descending=True).values
            probs = sorted_rows.softmax(-1)
            before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
            # The smallest prefix reaching top_p, the likeliest token always (a top_p that rounds
            # to 0 in float32 kept none); by score, so tokens tied with the last one kept stay too.
            kept = (before < _column(rows, [p.top_p for p in ps])).sum(-1, keepdim=True).clamp(min=1)
            return rows.masked_fill(rows < sorted_rows.gather(1, kept - 1), float("-inf"))

        scores = _on_rows(scores, top_p, params, keep_top_p)
    if min_p := [i for i, p in enumerate(params) if p.min_p > 0]:
        def keep_min_p(rows: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
            probs = rows.softmax(-1)
            return rows.masked_fill(probs < _column(rows, [p.min_p for p in ps]) * probs.amax(-1, keepdim=True),
                                    float("-inf"))

        scores = _on_rows(scores, min_p, params, keep_min_p)
    return scores


@dataclass
class FilterStats:
    """Rows' filtered distributions in three numbers each: with s = logits / temperature (penalised
    first), p_i = exp(s_i - log_norm) where s_i >= threshold, else 0 (every filter keeps the tokens
    scoring at least some threshold); `finite` is False where the row has no distribution (NaN or
    +inf logits, or nothing left)."""

    threshold: torch.Tensor  # [R] the smallest kept score
    log_norm: torch.Tensor  # [R] log of the kept tokens' sum of exp(s)
    finite: torch.Tensor  # [R] bool

    def probabilities(self, scores: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """p of the given logits of each row ([R, k]: whole rows, or some tokens' logits)."""
        s = scores / temperature[:, None]
        return torch.where(s >= self.threshold[:, None], torch.exp(s - self.log_norm[:, None]), 0.0)


def filter_stats(scores: torch.Tensor, params: Sequence[SamplingParams]) -> FilterStats:
    """`FilterStats` of every row of `scores` ([R, vocab], none greedy) with its own parameters:
    what `filter_rows` keeps, without writing the rows out (our CPU kernel: a pass or two over
    each row, no sort; elsewhere `filter_rows` itself)."""
    if _native(scores):
        from kernels import native

        return FilterStats(*native.op("filter_stats")(scores, *filter_columns(params)))
    return filter_stats_reference(scores, params)


def filter_columns(params: Sequence[SamplingParams]) -> tuple[torch.Tensor, ...]:
    """The rows' temperature, top_k, top_p and min_p as the CPU kernel takes them (on the host); a
    top_k past int64 (any k >= the vocabulary keeps every token) as the largest int64."""
    return (torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([min(p.top_k, INT64_MAX) for p in params], dtype=torch.int64),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor([p.min_p for p in params], dtype=torch.float32))


def filter_stats_reference(scores: torch.Tensor, params: Sequence[SamplingParams]) -> FilterStats:
    """`filter_stats` by `filter_rows` (what the kernel is tested against; any device)."""
    filtered = filter_rows(scores, params)
    scaled = scores / _column(scores, [p.temperature for p in params])
    finite = ~(scaled.isnan() | (scaled == math.inf)).any(-1) & (scaled.amax(-1) > -math.inf)
    threshold = filtered.masked_fill(filtered == -math.inf, math.inf).amin(-1)
    return FilterStats(threshold, filtered.logsumexp(-1), finite)


def argmax_rows(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max and the first index holding it (a NaN counts as the max, as in torch.argmax)."""
    if _native(scores):
        from kernels import native

        return native.op("row_argmax")(scores)
    return scores.max(-1)


def sample_rows(scores: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, stats: FilterStats,
                excluded: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """A token for each of `rows` of `scores`, by inverse CDF with its `uniform`, from its filtered
    distribution (`stats`, one per selected row) without its `excluded` tokens ([N, W], -1: none),
    renormalised (the whole distribution where they held all its mass)."""
    if _native(scores):
        from kernels import native

        return native.op("sample_rows")(scores, rows, temperature, stats.threshold, stats.log_norm, excluded,
                                        uniform)
    p = stats.probabilities(scores[rows], temperature)
    if excluded.numel():
        tried = torch.zeros_like(p).scatter_add_(1, excluded.clamp(min=0), (excluded >= 0).to(p.dtype))  # pads add 0
        rest = p.masked_fill(tried > 0, 0.0)
        p = torch.where(rest.sum(-1, keepdim=True) > 0, rest, p)
    return inverse_cdf(p, uniform)


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` (unnormalised), drawn with the row's uniform in [0, 1) (never
    a token of probability 0: a rounding that lands past the end falls back to the row's likeliest)."""
    cdf = probs.cumsum(-1)
    drawn = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp(max=probs.shape[-1] - 1)
    return torch.where(probs.gather(1, drawn) > 0, drawn, probs.argmax(-1, keepdim=True)).flatten()


def _native(scores: torch.Tensor) -> bool:
    """Whether our CPU kernels take these rows (fp32 on a CPU, where they could be built)."""
    if scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.dim() != 2:
        return False
    return _kernels_built()


@cache
def _kernels_built() -> bool:
    from kernels import native

    try:
        native.load()
    except native.KernelBuildError:
        return False
    return True


def _column(like: torch.Tensor, values: list, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype or like.dtype, device=like.device)[:, None]


def _on_rows(scores: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
             f: Callable[[torch.Tensor, list[SamplingParams]], torch.Tensor]) -> torch.Tensor:
    """`f` applied to the given rows of `scores` (all of them without copying them out)."""
    chosen = [params[i] for i in rows]
    if len(rows) == len(params):
        return f(scores, chosen)
    at = torch.tensor(rows, dtype=torch.int64, device=scores.device)
    return scores.index_copy(0, at, f(scores[at], chosen))


def sampling_distribution(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The probabilities the next token is drawn from (one-hot at the argmax when greedy)."""
    logits = apply_penalties(logits.float(), row) if row.params.needs_penalties else logits.float()
    if not math.isfinite(float(logits.max())):  # the max is NaN for any NaN, +inf for any +inf, -inf for none left
        raise SamplingError(NON_FINITE)
    if row.params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).float()
    return filter_logits(logits, row.params).softmax(-1)


NON_FINITE = "the model's logits are not finite (NaN or +inf): no distribution to sample from"


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability and the k most likely alternatives, under the model's
    own distribution (before penalties, temperature and filters)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, k) if k else None
    alternatives = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return float(logprobs[token]), alternatives
