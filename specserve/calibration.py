"""Measuring what a target forward of N tokens costs on this machine, once, and caching it.

The speculation policy interpolates the table (`cost_model.ForwardCost`) and corrects it with
measured steps; sizes are dense where a busy batch's decodes and trees sit, because a CPU's
matmuls grow in steps (docs/design.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from specserve.block_manager import BlockManager, BlockTable
from specserve.cost_model import DENSE_STEP, DENSE_UNTIL, ForwardCost
from specserve.model_runner import ModelRunner, TreeRequest
from specserve.tree import TokenTree

CALIBRATION_CONTEXT = 128
# Timed passes over the sizes (after one warm-up forward); the fastest per size. A neighbour's
# load only ever slows a forward, and on a busy VM the median of three still put bumps into the
# curve: where a size measured slower than the next, the non-decreasing fit made the rows
# between them free, and the policy drafted nodes there that cost what any row does.
REPEATS = 3


def calibration_sizes(max_tokens: int) -> list[int]:
    """1, 2, 4, then every DENSE_STEP up to DENSE_UNTIL, then doubling, and `max_tokens`."""
    dense = range(2 * DENSE_STEP, DENSE_UNTIL + 1, DENSE_STEP)
    sizes, n = sorted({1, 2, DENSE_STEP, *dense}), DENSE_UNTIL * 2
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return [*(size for size in sizes if size < max_tokens), max_tokens]


def measure(runner: ModelRunner, blocks: BlockManager, max_tokens: int, progress: bool = False,
            max_len: int | None = None) -> ForwardCost:
    """Time forwards of `calibration_sizes(max_tokens)` new tokens after a short context, in
    scratch blocks given back afterwards: after one warm-up forward, `REPEATS` timed passes (the
    fastest per size). Passes, not one size after another: a machine that slows for a few
    seconds then slows one pass, not a few neighbouring sizes, which would put a false step
    into the curve. No forward reaches past `max_len` positions (the model's length)."""
    sizes = calibration_sizes(max_tokens)
    capacity = min(blocks.num_free_blocks * blocks.block_size, max_len or sys.maxsize)
    context = min(CALIBRATION_CONTEXT, max(0, capacity - sizes[-1]))
    sizes = [n for n in sizes if context + n <= capacity] or [1]
    # One warm-up forward, of the largest size: the timed passes then find every buffer and
    # weight layout a forward needs built, and the fastest of three leaves out whatever a
    # shape's first call still costs (a whole warm-up pass was a quarter of the calibration).
    plan = [(sizes[-1], False)] + [(n, True) for n in sizes * REPEATS]
    table = BlockTable()
    blocks.ensure_slots(table, context + sizes[-1])
    times: dict[int, list[float]] = {n: [] for n in sizes}
    try:
        for n, timed in _progress(plan, progress):
            request = TreeRequest(TokenTree.chain([0] * n), context, table.block_ids, "last")
            start = time.perf_counter()
            runner.forward([request])
            if runner.device.type == "cuda":  # kernels run asynchronously: a step ends when they do
                torch.cuda.synchronize(runner.device)
            if timed:
                times[n].append(time.perf_counter() - start)
    finally:
        blocks.free(table)
    return ForwardCost(sizes, [min(times[n]) for n in sizes])


def load_or_measure(runner: ModelRunner, blocks: BlockManager, max_tokens: int, model_path: Path,
                    cache: Path | None = None, max_len: int | None = None) -> ForwardCost:
    """The cached table for this model, dtype and machine, or a fresh measurement (then cached)."""
    file = _cache_file(runner, model_path, max_tokens, cache)
    if file.exists():
        try:
            data = json.loads(file.read_text())
            return ForwardCost(list(data["sizes"]), list(data["seconds"]))
        except (ValueError, KeyError):
            pass  # a damaged cache entry: measure again
    cost = measure(runner, blocks, max_tokens, progress=True, max_len=max_len)
    file.parent.mkdir(parents=True, exist_ok=True)
    temporary = file.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(cost.to_json()))
    temporary.replace(file)
    return cost


def _cache_file(runner: ModelRunner, model_path: Path, max_tokens: int, cache: Path | None) -> Path:
    from kernels import native
    from specserve.machine import processor_name
    from specserve.pull import GGUF_FILE, cache_dir

    weights = sorted(Path(model_path).glob("*.safetensors")) + sorted(Path(model_path).glob(GGUF_FILE))
    key = json.dumps({
        "model": str(Path(model_path).resolve()),
        "weights": [(w.name, w.stat().st_size, int(w.stat().st_mtime)) for w in weights],
        "format": runner.model.weight_format(), "kernels": native.build_key(),
        "dtype": str(runner.model.dtype), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.machine(), "processor": processor_name(), "cpus": os.cpu_count(),
        # (an accelerator's name; CPU keys stay as they were, their cached tables still valid)
        **({"device": str(runner.device), "gpu": torch.cuda.get_device_name(runner.device)}
           if runner.device.type == "cuda" else {}),
        "block_size": runner.block_size, "max_tokens": max_tokens, "sizes": calibration_sizes(max_tokens),
        "per_size": "fastest",  # tables of medians (before) are measured again
        **({"tensor_parallel": runner.world_size} if runner.world_size > 1 else {}),
    }, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return (cache or cache_dir()) / "costs" / f"{Path(model_path).name}-{digest}.json"


def _progress(steps: list, show: bool):
    if not show:
        return steps
    from tqdm import tqdm

    return tqdm(steps, desc="calibrating forward cost", unit="forward", leave=False)
