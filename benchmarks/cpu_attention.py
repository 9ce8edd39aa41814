"""Tree attention on this CPU: our C++ kernel against the torch reference (CPU SDPA), per dtype.

The model's attention on a CPU takes the C++ kernel (`kernels/cpu/tree_attention.cpp`) for fp32
and bf16: each query row over exactly its visible keys, so a row never depends on the step's
others. The reference pads requests into SDPA calls, whose blocked loops are faster for long
chunks but round a row by its neighbours. This measures what that choice costs or saves per
step kind, both contenders on the same inputs, taking turns (median microseconds after warm-up).

    python benchmarks/cpu_attention.py [--heads 9 --kv-heads 3 --head-dim 64] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from report import write_report
from tqdm import tqdm

from kernels import cpu_attention, reference
from kernels.metadata import AttentionMetadata
from specserve.machine import processor_name
from specserve.tree import TokenTree

RESULTS = Path(__file__).parent / "results"
TREE8 = TokenTree(tuple(range(1, 9)), (-1, 0, 0, 1, 1, 2, 3, 3))
# name: (cached context, the tree each request adds, requests)
CASES = {
    "decode, 128 cached": (128, TokenTree.single(1), 1),
    "decode, 2048 cached": (2048, TokenTree.single(1), 1),
    "16 decodes, 512 cached": (512, TokenTree.single(1), 16),
    "8-node tree, 512 cached": (512, TREE8, 1),
    "chunk of 256, 256 cached": (256, TokenTree.chain(list(range(256))), 1),
    "prompt of 1024": (0, TokenTree.chain(list(range(1024))), 1),
}


def case(context: int, tree: TokenTree, requests: int, args, dtype: torch.dtype, block_size: int = 16):
    blocks = -(-(context + len(tree)) // block_size)
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(requests)]
    k_cache = torch.randn(requests * blocks, block_size, args.kv_heads, args.head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    meta = AttentionMetadata.build([tree] * requests, [context] * requests, tables, block_size)
    q = torch.randn(len(tree) * requests, args.heads, args.head_dim).to(dtype)
    return q, k_cache, v_cache, meta


def in_turns(calls: dict[str, Callable[[], object]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median microseconds per call, the contenders alternating call by call."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=9)  # SmolLM2's: 9 query heads over 3 K/V heads of 64
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=str(RESULTS / "cpu-attention"))
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    records, rows = [], []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for name, (context, tree, requests) in tqdm(CASES.items(), desc=f"attention {dtype_name}", unit="case"):
            inputs = (*case(context, tree, requests, args, dtype), args.head_dim**-0.5)
            us = in_turns({"ours": partial(cpu_attention.paged_tree_attention, *inputs),
                           "sdpa": partial(reference.paged_tree_attention, *inputs)}, args.repeats)
            difference = (cpu_attention.paged_tree_attention(*inputs).float()
                          - reference.paged_tree_attention(*inputs).float()).abs().max().item()
            records.append({"dtype": dtype_name, "case": name, "context": context, "tree": len(tree),
                            "requests": requests, "ours_us": us["ours"], "sdpa_us": us["sdpa"],
                            "max_abs_difference": difference})
            rows.append([dtype_name, name, f"{us['ours']:.0f}", f"{us['sdpa']:.0f}", f"{us['ours'] / us['sdpa']:.2f}x"])
    machine = processor_name()
    caption = (f"Tree attention per layer on `{machine}`, {torch.get_num_threads()} threads, {args.heads} query heads "
               f"over {args.kv_heads} K/V heads of {args.head_dim}, blocks of 16; median us of {args.repeats} calls, "
               "the contenders alternating. ours: the C++ kernel (each row alone); sdpa: the torch reference.")
    write_report(args.out, {"machine": machine, "threads": torch.get_num_threads(), "heads": args.heads,
                            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "records": records},
                 caption, ["dtype", "step", "ours us", "sdpa us", "ours / sdpa"], rows)


if __name__ == "__main__":
    main()
