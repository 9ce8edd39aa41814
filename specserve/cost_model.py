"""What a target forward costs, as statistics: the calibrated curve of a forward's time by its
new tokens (`ForwardCost`, interpolated between measured sizes) and the per-batch-size fit of
measured steps the speculation policy corrects it with (`StepCost`). Measuring the curve and
caching it: `specserve.calibration`.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass, replace
from functools import cache

import numpy as np

DENSE_STEP = 4  # the curve's sizes every this many tokens up to DENSE_UNTIL, then doubling
DENSE_UNTIL = 128
REFIT_SECONDS = 1.0  # measured step time after which the fit is redone (see `StepCost.add`)
EAGER_FITS = 2  # a window's first EAGER_FITS x min_samples samples are each fitted at once


class RecentMedian:
    """The median of the last `window` timings, once there are `min_samples` of them (None
    before). Robust where a running mean is not: the first forward of a new shape (oneDNN
    builds its kernels) or a noisy neighbour can take several times the usual, and a cost
    estimate stuck high would stop the very speculation that would measure it again."""

    def __init__(self, window: int = 16, min_samples: int = 3):
        self._samples: deque[float] = deque(maxlen=window)
        self.min_samples = min_samples
        self._value: float | None = None  # read every step's plan for every tree size: kept, not recomputed

    def add(self, value: float) -> None:
        self._samples.append(value)
        self._value = statistics.median(self._samples) if len(self._samples) >= self.min_samples else None

    @property
    def value(self) -> float | None:
        return self._value


@dataclass(frozen=True)
class StepFit:
    """A batch size's measured step costs, against the calibrated curve T (see `StepCost`)."""

    fixed: float = 0.0  # seconds every step pays whatever its rows and keys (its sequences' bookkeeping)
    scale: float = 1.0  # measured / calibrated, for the step's rows
    chunk_overhead: float = 0.0  # seconds a step with prompt chunks pays beyond their rows
    per_key: float = 0.0  # seconds per key position the decodes' padded attention reads
    tree_overhead: float = 0.0  # seconds a step pays for having trees at all
    per_node: float = 0.0  # seconds per drafted node beyond its rows on the curve (its logits, verifying it)

    def plain(self, rows: np.ndarray | float, chunked: np.ndarray | bool, keys: np.ndarray | int) -> np.ndarray | float:
        """Seconds of a step without trees whose rows cost `rows` on the calibrated curve."""
        return self.fixed + self.per_key * keys + self.scale * rows + self.chunk_overhead * chunked


class StepCost:
    """What a step of one batch size costs, fitted to recent measured steps:

        seconds = fixed + per_key * keys + scale * T(base_tokens) + chunk_overhead * [prompt chunks]
                  + tree_overhead * [nodes > 0] + scale * (T(base_tokens + nodes) - T(base_tokens))
                  + per_node * nodes.

    The calibrated curve T times one sequence's forward by its rows: the matmuls, which every row
    of a batch pays alike. A batch of many decodes also pays per sequence (each one's attention
    over its own context, its metadata), which no extra row changes: that is `fixed`. Scaling the
    curve by measured / calibrated instead would charge a node on top of 64 decodes the
    whole batch's attention share (there, nearly three times a row's real price), and a node
    priced too dear is never drafted, so never measured cheaper. The plain steps give `fixed`
    and `scale`: a Theil-Sen line through (T(base_tokens), seconds) where prompt chunks make
    the steps' rows differ; where they do not, what the curve does not explain is `fixed` (the
    curve's rows kept at their calibrated price or below: a row found dearer in a batch is
    measured by the trees, a row priced dearer than it is never is). A step with prompt chunks
    attends over them in a call of its own: where both kinds were measured, `fixed` is the
    decode-only steps' and the chunks' steps pay `chunk_overhead` on top, so that a busy
    server's decode steps, most of its steps, are not priced as the average of both (a decode
    step priced dearer than it is makes every tree measured against it look cheap). Likewise
    the decodes' attention: padded to their longest sequence, it reads decodes x that length
    keys (`keys`), which doubles when one long prompt joins a batch of short ones, and a fit
    that learnt this only from its window's steps would price the next dozens of steps as the
    last dozens were (trees drafted just when plain steps got cheaper again, wrongly priced).
    Where the window's steps differ in keys, `per_key` prices them (Theil-Sen).

    A drafted node is a row: it costs what the curve says the step's next rows cost (scaled),
    which is where the matmuls' steps are (see the module's docstring): the first few nodes on
    top of a batch may be nearly free and the next few dear. Trees then add what the plain steps
    cannot see: an attention call of their own, their nodes' logits and verification. Their
    samples' residuals over the plain fit and their rows give a price per node beyond its row
    (Theil-Sen over tree sizes, never below zero: a row costs at least what it does in a chain)
    and, above it, the overhead of having trees at all, so that one small tree is known to be
    dear while many nodes at once may still pay; with too few tree sizes to tell them apart the
    nodes carry it all. A warm-up outlier or a noisy neighbour's slow step moves none of the
    medians.
    """

    def __init__(self, curve: ForwardCost, window: int = 32, min_samples: int = 3, tree_memory: int = 500):
        self.curve = curve
        self.min_samples = min_samples
        # Per step: base_tokens, T(base_tokens), nodes, seconds, T(base_tokens + nodes), chunked, keys. Plain
        # steps and steps with trees are kept apart, `window` of each: a busy server runs tree
        # steps seldom, and its plain steps must not push out what those measured, or every few
        # dozen steps the price of trees would fall back to the curve's and another costly tree
        # step would go to measure it again.
        self._plain: deque[tuple[int, float, float, float, float, bool, int]] = deque(maxlen=window)
        self._trees: deque[tuple[int, float, float, float, float, bool, int]] = deque(maxlen=window)
        # But not for ever: trees found dear are not drafted, so nothing would re-measure them,
        # and a few slow steps (a noisy neighbour) would switch trees off at this batch size for
        # good. Tree samples older than `tree_memory` steps are forgotten; then the next trees
        # are priced by the plain steps again and measured anew (a few steps per `tree_memory`).
        self.tree_memory = tree_memory
        self._tree_steps: deque[int] = deque(maxlen=window)  # when each tree sample was taken
        self._steps = 0
        self._fitted: StepFit | None = None
        self._since_fit = 0.0  # seconds of the steps added since
        self._node_bounds: dict[int, float] = {}  # node_seconds by base_tokens, for the current fit
        self._added: dict[int, list[float]] = {}  # added_seconds by base_tokens, for the current fit

    def add(self, base_tokens: int, nodes: int, seconds: float, chunked: bool = False, keys: int = 0) -> None:
        """A measured step: `base_tokens` of decodes and prompt chunks (`chunked`: some of them
        prompt tokens), `nodes` drafted nodes; `keys`: decodes x their longest sequence."""
        sample = (base_tokens, self.curve(base_tokens), float(nodes), seconds, self.curve(base_tokens + nodes),
                  chunked, keys)
        self._steps += 1
        if nodes:
            self._trees.append(sample)
            self._tree_steps.append(self._steps)
        else:
            self._plain.append(sample)
        while self._tree_steps and self._tree_steps[0] <= self._steps - self.tree_memory:
            self._tree_steps.popleft()
            self._trees.popleft()
            self._fitted = None  # what was forgotten leaves the fit now
        # Refit at once while the sample's window holds its first few samples (they change the
        # fit most), else once the steps since the last fit took REFIT_SECONDS: later samples
        # move the medians little, and a refit (over half a millisecond with the caches cold from
        # the forward) would cost short steps a measurable share if it came every few of them.
        # A busy server's tree window seldom fills (its trees are few, and forgotten after
        # `tree_memory` steps): refitting on every tree step until it did made the bookkeeping
        # around its trees cost about what they gained.
        self._since_fit += seconds
        window = self._trees if nodes else self._plain
        if len(window) < EAGER_FITS * self.min_samples or self._since_fit >= REFIT_SECONDS:
            self._fitted = None

    def seconds(self, base_tokens: int, nodes: np.ndarray | int, chunked: bool = False,
                keys: int = 0) -> np.ndarray | float:
        """Predicted time of a step with `base_tokens` (`chunked`: some of them prompt tokens),
        `keys` (see `add`) and `nodes` drafted nodes."""
        plain = self.fit().plain(self.curve(base_tokens), chunked, keys)
        if isinstance(nodes, np.ndarray):
            return plain + np.asarray(self.added_seconds(base_tokens, int(nodes.max(initial=0))))[nodes]
        return plain + self.added_seconds(base_tokens, nodes)[nodes]

    def added_seconds(self, base_tokens: int, nodes: int) -> list[float]:
        """What 0, 1, ..., at least `nodes` drafted nodes add to a step with `base_tokens`: the tree
        overhead, their rows on the curve (scaled) and their price beyond. A list, kept per fit:
        the policy prices every plan size of a step from it, at one sequence in plain Python
        (numpy's per-call cost, with the caches cold from the forward, was most of a batch-1 plan)."""
        fit = self.fit()
        added = self._added.get(base_tokens)
        if added is None or len(added) <= nodes:
            counts = np.arange(max(nodes, DENSE_UNTIL) + 1)
            rows = self.curve.many(base_tokens + counts)
            rows -= rows[0]  # the step's own rows (no nodes)
            added = (fit.tree_overhead * (counts > 0) + fit.scale * rows + fit.per_node * counts).tolist()
            self._added[base_tokens] = added
        return added

    def node_seconds(self, base_tokens: int) -> float:
        """The least a drafted node costs in a step with `base_tokens` (beyond the tree overhead):
        the cheapest average over the first 1 .. DENSE_UNTIL nodes, so that no plan of nodes
        priced at least this is missed by a step deciding from it that none pays."""
        fit = self.fit()
        if base_tokens not in self._node_bounds:
            counts = np.arange(1, DENSE_UNTIL + 1)
            rows = (self.curve.many(base_tokens + counts) - self.curve(base_tokens)) / counts
            self._node_bounds[base_tokens] = fit.scale * float(rows.min()) + fit.per_node
        return self._node_bounds[base_tokens]

    def fit(self) -> StepFit:
        """The fit of the recent steps: the curve as it is before `min_samples` steps; no price
        per node beyond its rows before `min_samples` plain steps and as many with trees."""
        if self._fitted is None:
            self._fitted = self._fit()
            self._node_bounds.clear()
            self._added.clear()
            self._since_fit = 0.0
        return self._fitted

    def _fit(self) -> StepFit:
        if len(self._plain) + len(self._trees) < self.min_samples:
            return StepFit()
        if len(self._plain) < self.min_samples:
            return self._fit_mostly_trees()
        _, rows, _, seconds, _, chunked, keys = np.asarray(self._plain).T
        plain_fit = self._fit_plain(rows, seconds, chunked > 0, keys)
        if len(self._trees) < self.min_samples:
            return plain_fit
        _, rows, nodes, seconds, with_nodes, chunked, keys = np.asarray(self._trees).T
        residual = seconds - plain_fit.plain(rows, chunked, keys) - plain_fit.scale * (with_nodes - rows)
        if not _spread(nodes):
            return replace(plain_fit, per_node=max(0.0, _median(residual / nodes)))
        per_node = max(0.0, _median_slope(residual, nodes))
        overhead = _median(residual - per_node * nodes)
        return replace(plain_fit, tree_overhead=max(0.0, overhead), per_node=per_node)

    def _fit_plain(self, rows: np.ndarray, seconds: np.ndarray, chunked: np.ndarray, keys: np.ndarray) -> StepFit:
        """The plain steps' fit: the price of a row from the steps whose prompt chunks differ
        (all plain steps while those are few); the price of a key from the decode-only steps
        (all while those are few), where their keys differ; `fixed` from them, and the chunks'
        overhead from theirs (where both kinds have `min_samples`; else one `fixed` for all)."""
        decodes = ~chunked
        few = min(int(decodes.sum()), int(chunked.sum())) < self.min_samples
        fixed, scale = _affine(rows, seconds) if few else _affine(rows[chunked], seconds[chunked])
        residual = seconds - scale * rows
        base = np.ones_like(decodes) if decodes.sum() < self.min_samples else decodes
        apart = 0.1 * _median(keys[base])
        per_key = 0.0
        if apart > 0 and _range(keys[base]) > apart:
            per_key = max(0.0, _median_slope(residual[base], keys[base], apart))
        residual -= per_key * keys
        fixed = fixed if few and not per_key else _median(residual[base])
        chunk_overhead = 0.0 if few else _median(residual[chunked]) - fixed
        return StepFit(fixed, scale, chunk_overhead, per_key)

    def _fit_mostly_trees(self) -> StepFit:
        """A speculating engine may run few plain steps (at batch 1, nearly every step has a
        tree): then every step is measured against the curve with its nodes' rows,
        seconds / T(base_tokens + nodes) = scale + per_node * nodes / T(base_tokens + nodes), and
        where no two differ in nodes the curve prices them (per_node 0)."""
        _, _, nodes, seconds, with_nodes, _, _ = np.asarray([*self._plain, *self._trees]).T
        if not _spread(nodes / with_nodes):
            return StepFit(scale=_median(seconds / with_nodes))
        per_node = max(0.0, _median_slope(seconds / with_nodes, nodes / with_nodes))
        return StepFit(scale=_median((seconds - per_node * nodes) / with_nodes), per_node=per_node)


def decode_keys(lengths: list[int]) -> int:
    """The key positions a step's decodes read, given their sequences' lengths: their attention
    is padded to the longest (see `StepCost`)."""
    return len(lengths) * max(lengths, default=0)


def _affine(rows: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """(fixed, scale) of seconds = fixed + scale * rows: Theil-Sen where the steps' rows differ
    (by prompt chunks; at least by a tenth), else (or where that line makes no sense) the rows at
    the measured ratio, capped at 1, and the rest fixed."""
    apart = 0.1 * _median(rows)
    if _range(rows) > apart:
        scale = _median_slope(seconds, rows, apart)
        fixed = _median(seconds - scale * rows)
        if scale > 0 and fixed >= 0:
            return fixed, scale
    scale = min(1.0, _median(seconds / rows))
    return max(0.0, _median(seconds - scale * rows)), scale


def _spread(x: np.ndarray) -> bool:
    return bool(_range(x) > 1e-9)


def _median_slope(y: np.ndarray, x: np.ndarray, apart: float = 1e-9) -> float:
    """Theil-Sen: the median slope over the pairs of points more than `apart` apart in x."""
    i, j = _pairs(len(x))
    far = np.abs(x[j] - x[i]) > apart
    return _median((y[j] - y[i])[far] / (x[j] - x[i])[far])


# The fit runs on the step's critical path, with the caches cold from the forward: there numpy's
# `median` (nine layers of Python each) made a refit cost 1-2 ms at 8 clients (of an 11 ms step).


def _median(x: np.ndarray) -> float:
    """`np.median`'s value (an even count: the mean of the middle two) from one sort."""
    ordered = np.sort(x, axis=None)
    middle = len(ordered) // 2
    return float(ordered[middle]) if len(ordered) % 2 else float((ordered[middle - 1] + ordered[middle]) / 2)


def _range(x: np.ndarray) -> float:
    return float(x.max() - x.min())


@cache
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every pair i < j of n points (`np.triu_indices(n, 1)`), kept: windows have a few sizes."""
    return np.triu_indices(n, 1)


@dataclass
class ForwardCost:
    """Seconds of a forward by number of new tokens: piecewise linear through measured sizes."""

    sizes: list[int]
    seconds: list[float]

    def __post_init__(self) -> None:
        self._sizes = [float(n) for n in self.sizes]
        # Non-decreasing: a forward of more tokens never costs less. Timing noise where rows are
        # nearly free can say otherwise, and a curve with T(2) < T(1) would have the policy draft
        # a node to save time. The least-squares non-decreasing curve (not the running maximum,
        # which would carry one slow measurement's price over every size after it).
        self._seconds = _non_decreasing(self.seconds)
        self._array = (np.asarray(self._sizes), np.asarray(self._seconds))

    def __call__(self, num_tokens: int) -> float:
        """Seconds for a forward of `num_tokens` (beyond the ends: the end segments extended). In
        plain Python: the policy asks several times a step, and numpy's per-call overhead would
        cost a small batch's step a measurable share."""
        n, sizes, seconds = max(num_tokens, 1), self._sizes, self._seconds
        if len(sizes) == 1:
            return seconds[0] * n / sizes[0]
        i = min(max(bisect.bisect_left(sizes, n), 1), len(sizes) - 1)
        n0, n1, t0, t1 = sizes[i - 1], sizes[i], seconds[i - 1], seconds[i]
        return max(t0 + (t1 - t0) * (n - n0) / (n1 - n0), 1e-6)

    def many(self, num_tokens: np.ndarray) -> np.ndarray:
        """`self(n)` for every n of an array at once (the policy prices every plan size together)."""
        sizes, seconds = self._array
        n = np.maximum(np.asarray(num_tokens, np.float64), 1.0)
        if len(sizes) == 1:
            return seconds[0] * n / sizes[0]
        out = np.interp(n, sizes, seconds)
        for beyond, (i, j) in ((n < sizes[0], (0, 1)), (n > sizes[-1], (-2, -1))):  # the end segments extended
            if beyond.any():
                slope = (seconds[j] - seconds[i]) / (sizes[j] - sizes[i])
                out[beyond] = seconds[i] + slope * (n[beyond] - sizes[i])
        return np.maximum(out, 1e-6)

    def to_json(self) -> dict:
        return {"sizes": self.sizes, "seconds": self.seconds}


def _non_decreasing(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit (pool adjacent violators): each run that falls is
    replaced by its mean."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [mean for mean, count in blocks for _ in range(int(count))]
