"""Tree attention on this CPU: our C++ kernel against the torch reference (CPU SDPA), per dtype.

The model's attention on a CPU takes the C++ kernel (`kernels/cpu/tree_attention.cpp`) for fp32
and bf16, and over int8 caches (`int8`: fp32 queries, as `--kv-cache-dtype int8` runs): each
query row over exactly its visible keys, so a row never depends on the step's others. The
reference pads requests into SDPA calls, whose blocked loops are faster for long chunks but
round a row by its neighbours. This measures what that choice costs or saves per step kind, both
contenders on the same inputs, taking turns (median microseconds after warm-up).

`--against REV` adds the kernel as it was at a git revision (built beside ours under another
op namespace) as a third contender in the same process, and checks that its results equal ours
bit for bit: how a kernel change is measured on a host whose speed drifts between runs.

    python benchmarks/cpu_attention.py [--heads 9 --kv-heads 3 --head-dim 64] [--dtypes float32 bfloat16 int8]
                                       [--against HEAD]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from report import write_report
from tqdm import tqdm

from kernels import cpu_attention, native, reference
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
    """Queries and caches of `dtype`; int8: fp32 queries over an int8 cache (`--kv-cache-dtype int8`)."""
    blocks = -(-(context + len(tree)) // block_size)
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(requests)]
    values = dtype if dtype != torch.int8 else torch.float32
    k_cache = torch.randn(requests * blocks, block_size, args.kv_heads, args.head_dim).to(values)
    v_cache = torch.randn_like(k_cache)
    if dtype == torch.int8:
        k_cache, v_cache = reference.quantize_kv(k_cache), reference.quantize_kv(v_cache)
    meta = AttentionMetadata.build([tree] * requests, [context] * requests, tables, block_size)
    q = torch.randn(len(tree) * requests, args.heads, args.head_dim).to(values)
    return q, k_cache, v_cache, meta


def kernel_at(revision: str) -> Callable[..., torch.Tensor]:
    """`tree_attention` as `kernels/cpu/tree_attention.cpp` was at `revision`, built with our flags
    under the op namespace `specserve_at_<commit>`."""
    root = Path(__file__).resolve().parent.parent
    commit = subprocess.run(["git", "rev-parse", "--short", revision], cwd=root, check=True, capture_output=True,
                            text=True).stdout.strip()
    namespace = f"specserve_at_{commit}"
    build = native.build_root() / namespace
    build.mkdir(parents=True, exist_ok=True)
    source = build / "tree_attention.cpp"
    for path in (native.SOURCES[0].parent / "tree_attention.cpp", *native.HEADERS):
        shown = subprocess.run(["git", "show", f"{commit}:kernels/cpu/{path.name}"], cwd=root, capture_output=True,
                               text=True)
        if shown.returncode and path in native.HEADERS:
            continue  # a header newer than the revision (whose kernel does not include it)
        shown.check_returncode()
        (build / path.name).write_text(shown.stdout.replace("specserve_cpu", namespace))
    native.load()
    native.compile_library(namespace, [source], build)
    op = getattr(torch.ops, namespace).tree_attention

    def attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return op(q, k_cache, v_cache, meta.query_start_loc, meta.context_lens, meta.block_tables, meta.ancestor_mask,
                  scale)

    return attention


def in_turns(calls: dict[str, Callable[[], object]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median microseconds per call, the contenders alternating call by call, their order rotated
    every repeat: each follows every other as often. In a fixed order the call after SDPA (whose
    padded buffers empty the caches) always ran cold and the one after it found the same K/V
    warm, which made a kernel 1.1-1.6x slower than itself on decodes."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[: repeat % len(names)]:
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=9)  # SmolLM2's: 9 query heads over 3 K/V heads of 64
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"],
                        help="int8: fp32 queries over an int8 cache")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls of each contender before timing")
    parser.add_argument("--against", metavar="REV", help="also time the kernel as it was at this git revision")
    parser.add_argument("--out", default=str(RESULTS / "cpu-attention"))
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    earlier = kernel_at(args.against) if args.against else None
    records, rows = [], []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for name, (context, tree, requests) in tqdm(CASES.items(), desc=f"attention {dtype_name}", unit="case"):
            inputs = (*case(context, tree, requests, args, dtype), args.head_dim**-0.5)
            calls = {"ours": partial(cpu_attention.paged_tree_attention, *inputs),
                     "sdpa": partial(reference.paged_tree_attention, *inputs)}
            if earlier is not None:
                calls[args.against] = partial(earlier, *inputs)
                if not torch.equal(calls["ours"](), calls[args.against]()):
                    raise SystemExit(f"{name}, {dtype_name}: ours and {args.against}'s kernel give different results")
            us = in_turns(calls, args.repeats, args.warmup)
            difference = (calls["ours"]().float() - calls["sdpa"]().float()).abs().max().item()
            record = {"dtype": dtype_name, "case": name, "context": context, "tree": len(tree), "requests": requests,
                      "ours_us": us["ours"], "sdpa_us": us["sdpa"], "max_abs_difference": difference}
            row = [dtype_name, name, f"{us['ours']:.0f}", f"{us['sdpa']:.0f}", f"{us['ours'] / us['sdpa']:.2f}x"]
            if earlier is not None:
                record["against_us"] = us[args.against]
                row += [f"{us[args.against]:.0f}", f"{us['ours'] / us[args.against]:.2f}x"]
            records.append(record)
            rows.append(row)
    machine = processor_name()
    caption = (f"Tree attention per layer on `{machine}`, {torch.get_num_threads()} threads, {args.heads} query heads "
               f"over {args.kv_heads} K/V heads of {args.head_dim}, blocks of 16; median us of {args.repeats} calls "
               f"after {args.warmup} untimed, "
               "the contenders alternating. ours: the C++ kernel (each row alone); sdpa: the torch reference.")
    columns = ["dtype", "step", "ours us", "sdpa us", "ours / sdpa"]
    if earlier is not None:
        caption += f" {args.against}: our kernel as it was at that revision (results equal to ours bit for bit)."
        columns += [f"{args.against} us", f"ours / {args.against}"]
    write_report(args.out, {"machine": machine, "threads": torch.get_num_threads(), "heads": args.heads,
                            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "against": args.against,
                            "records": records}, caption, columns, rows)


if __name__ == "__main__":
    main()
