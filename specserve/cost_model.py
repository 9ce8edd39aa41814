"""What a target forward of N tokens costs on this machine, measured once and cached.

Speculation trades forward size for tokens: a verification tree adds rows to the step's
forward, and whether that pays depends on how the forward's time grows with its rows, which
differs by model, dtype and machine (on a 2-core CPU, 32 rows of SmolLM2 in bf16 cost about
one decode step; on a big batch each extra row costs real time). So the engine times a
forward of N tokens (after a 128-token context) for N = 1, 2, 4, ... up to its token budget
at start-up, caches the table under the user cache dir, and interpolates between sizes.
(While serving, the speculation policy corrects the curve with measured steps.)
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import platform
import statistics
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from specserve.block_manager import BlockManager, BlockTable
from specserve.model_runner import ModelRunner, TreeRequest
from specserve.tree import TokenTree

CALIBRATION_CONTEXT = 128
REPEATS = 3
SLOPE_SPAN = 16  # tokens over which a curve's local slope is taken
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

    def add(self, value: float) -> None:
        self._samples.append(value)

    @property
    def value(self) -> float | None:
        return statistics.median(self._samples) if len(self._samples) >= self.min_samples else None


@dataclass(frozen=True)
class StepFit:
    """A batch size's measured step costs, against the calibrated curve T (see `StepCost`)."""

    fixed: float = 0.0  # seconds every step pays whatever its rows and keys (its sequences' bookkeeping)
    scale: float = 1.0  # measured / calibrated, for the step's rows
    chunk_overhead: float = 0.0  # seconds a step with prompt chunks pays beyond their rows
    per_key: float = 0.0  # seconds per key position the decodes' padded attention reads
    tree_overhead: float = 0.0  # seconds a step pays for having trees at all
    per_node: float | None = None  # seconds per drafted node (None: not measured yet)

    def plain(self, rows: np.ndarray | float, chunked: np.ndarray | bool, keys: np.ndarray | int) -> np.ndarray | float:
        """Seconds of a step without trees whose rows cost `rows` on the calibrated curve."""
        return self.fixed + self.per_key * keys + self.scale * rows + self.chunk_overhead * chunked


class StepCost:
    """What a step of one batch size costs, fitted to recent measured steps:

        seconds = fixed + per_key * keys + scale * T(base_tokens) + chunk_overhead * [prompt chunks]
                  + tree_overhead * [nodes > 0] + node_price * nodes.

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

    Trees then add what the plain steps cannot see: an attention call of their own, their
    nodes' logits and verification. Their samples' residuals over the plain fit give a price per
    node (Theil-Sen over tree sizes) and, above it, the overhead of having trees at all, so that
    one small tree is known to be dear while many nodes at once may still pay; with too few tree
    sizes to tell them apart the nodes carry it all. A warm-up outlier or a noisy neighbour's
    slow step moves none of the medians. A node never costs less than the curve's slope
    (scaled): a row costs at least what it does in a chain.
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
        fit = self.fit()
        plain = fit.plain(self.curve(base_tokens), chunked, keys)
        return plain + fit.tree_overhead * (nodes > 0) + self.node_seconds(base_tokens) * nodes

    def node_seconds(self, base_tokens: int) -> float:
        """The price of one drafted node in a step with `base_tokens` (beyond the tree overhead)."""
        fit = self.fit()
        floor = fit.scale * self.curve.slope(base_tokens)
        return floor if fit.per_node is None else max(fit.per_node, floor)

    def fit(self) -> StepFit:
        """The fit of the recent steps: the curve as it is before `min_samples` steps; no price
        per node before `min_samples` plain steps and as many with trees."""
        if self._fitted is None:
            self._fitted = self._fit()
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
        bases, rows, nodes, seconds, _, chunked, keys = np.asarray(self._trees).T
        residual = seconds - plain_fit.plain(rows, chunked, keys)
        floors = plain_fit.scale * np.array([self.curve.slope(int(base)) for base in bases])
        if not _spread(nodes):
            return replace(plain_fit, per_node=float(np.median(residual / nodes)))
        per_node = _median_slope(residual, nodes)
        overhead = float(np.median(residual - np.maximum(per_node, floors) * nodes))
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
        apart = 0.1 * float(np.median(keys[base]))
        per_key = 0.0
        if apart > 0 and np.ptp(keys[base]) > apart:
            per_key = max(0.0, _median_slope(residual[base], keys[base], apart))
        residual -= per_key * keys
        fixed = fixed if few and not per_key else float(np.median(residual[base]))
        chunk_overhead = 0.0 if few else float(np.median(residual[chunked])) - fixed
        return StepFit(fixed, scale, chunk_overhead, per_key)

    def _fit_mostly_trees(self) -> StepFit:
        """A speculating engine may run few plain steps (at batch 1, nearly every step has a
        tree): then every step is measured against the curve, seconds / T(base_tokens) =
        scale + per_node * nodes / T(base_tokens), and where no two differ in nodes the curve
        prices them (the scale from seconds / T(base_tokens + nodes))."""
        _, rows, nodes, seconds, with_nodes, _, _ = np.asarray([*self._plain, *self._trees]).T
        if not _spread(nodes / rows):
            return StepFit(scale=float(np.median(seconds / with_nodes)))
        per_node = _median_slope(seconds / rows, nodes / rows)
        return StepFit(scale=float(np.median((seconds - per_node * nodes) / rows)), per_node=per_node)


def decode_keys(lengths: list[int]) -> int:
    """The key positions a step's decodes read, given their sequences' lengths: their attention
    is padded to the longest (see `StepCost`)."""
    return len(lengths) * max(lengths, default=0)


def _affine(rows: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """(fixed, scale) of seconds = fixed + scale * rows: Theil-Sen where the steps' rows differ
    (by prompt chunks; at least by a tenth), else (or where that line makes no sense) the rows at
    the measured ratio, capped at 1, and the rest fixed."""
    apart = 0.1 * float(np.median(rows))
    if np.ptp(rows) > apart:
        scale = _median_slope(seconds, rows, apart)
        fixed = float(np.median(seconds - scale * rows))
        if scale > 0 and fixed >= 0:
            return fixed, scale
    scale = min(1.0, float(np.median(seconds / rows)))
    return max(0.0, float(np.median(seconds - scale * rows))), scale


def _spread(x: np.ndarray) -> bool:
    return bool(np.ptp(x) > 1e-9)


def _median_slope(y: np.ndarray, x: np.ndarray, apart: float = 1e-9) -> float:
    """Theil-Sen: the median slope over the pairs of points more than `apart` apart in x."""
    i, j = np.triu_indices(len(x), 1)
    far = np.abs(x[j] - x[i]) > apart
    return float(np.median((y[j] - y[i])[far] / (x[j] - x[i])[far]))


@dataclass
class ForwardCost:
    """Seconds of a forward by number of new tokens: piecewise linear through measured sizes."""

    sizes: list[int]
    seconds: list[float]

    def __post_init__(self) -> None:
        self._sizes = [float(n) for n in self.sizes]
        # Non-decreasing: a forward of more tokens never costs less. Timing noise at the small
        # sizes (where rows are nearly free) can say otherwise, and a curve with T(2) < T(1)
        # would have the policy draft a node to save time.
        self._seconds = np.maximum.accumulate(np.asarray(self.seconds, np.float64)).tolist()

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

    def slope(self, num_tokens: int) -> float:
        """Seconds per extra token of a forward of `num_tokens` (over the next `SLOPE_SPAN`)."""
        return (self(num_tokens + SLOPE_SPAN) - self(num_tokens)) / SLOPE_SPAN

    def to_json(self) -> dict:
        return {"sizes": self.sizes, "seconds": self.seconds}


def calibration_sizes(max_tokens: int) -> list[int]:
    sizes, n = [], 1
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return [*sizes, max_tokens]


def measure(runner: ModelRunner, blocks: BlockManager, max_tokens: int, progress: bool = False) -> ForwardCost:
    """Time forwards of 1, 2, 4, ... `max_tokens` new tokens after a short context (median of
    `REPEATS` after a warm-up), in scratch blocks given back afterwards."""
    sizes = calibration_sizes(max_tokens)
    capacity = blocks.num_free_blocks * blocks.block_size
    context = min(CALIBRATION_CONTEXT, max(0, capacity - sizes[-1]))
    sizes = [n for n in sizes if context + n <= capacity] or [1]
    table = BlockTable()
    blocks.ensure_slots(table, context + sizes[-1])
    seconds = []
    try:
        for n in _progress(sizes, progress):
            tree = TokenTree.chain([0] * n)
            times = []
            for _ in range(REPEATS + 1):
                start = time.perf_counter()
                runner.forward([TreeRequest(tree, context, table.block_ids, "last")])
                times.append(time.perf_counter() - start)
            seconds.append(statistics.median(times[1:]))
    finally:
        blocks.free(table)
    return ForwardCost(sizes, seconds)


def load_or_measure(runner: ModelRunner, blocks: BlockManager, max_tokens: int, model_path: Path,
                    cache: Path | None = None) -> ForwardCost:
    """The cached table for this model, dtype and machine, or a fresh measurement (then cached)."""
    file = _cache_file(runner, model_path, max_tokens, cache)
    if file.exists():
        try:
            data = json.loads(file.read_text())
            return ForwardCost(list(data["sizes"]), list(data["seconds"]))
        except (ValueError, KeyError):
            pass  # a damaged cache entry: measure again
    cost = measure(runner, blocks, max_tokens, progress=True)
    file.parent.mkdir(parents=True, exist_ok=True)
    temporary = file.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(cost.to_json()))
    temporary.replace(file)
    return cost


def _cache_file(runner: ModelRunner, model_path: Path, max_tokens: int, cache: Path | None) -> Path:
    from specserve.pull import cache_dir

    weights = sorted(Path(model_path).glob("*.safetensors"))
    key = json.dumps({
        "model": str(Path(model_path).resolve()),
        "weights": [(w.name, w.stat().st_size, int(w.stat().st_mtime)) for w in weights],
        "dtype": str(runner.model.dtype), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
        "block_size": runner.block_size, "max_tokens": max_tokens,
    }, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return (cache or cache_dir()) / "costs" / f"{Path(model_path).name}-{digest}.json"


def _progress(sizes: list[int], show: bool):
    if not show:
        return sizes
    from tqdm import tqdm

    return tqdm(sizes, desc="calibrating forward cost", unit="size", leave=False)
