"""Compile every Triton kernel for a CUDA GPU on a machine without one (run as its own process).

Triton's interpreter runs a kernel's Python, not the compiler: code it accepts can still fail to
compile (a global that is not constexpr, a masked load's `other` that cannot be cast to fp8).
This drives the real launch paths of `kernels.tree_attention` under a stand-in driver that names
a target GPU, so each launch compiles down to a cubin (Triton ships ptxas) and is not run.

    python tests/kernels/compile_for_gpu.py [--arch 90] [--all-configs]

Prints one line per compiled case and exits 1 if any failed to compile.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_for_gpu.py compiles kernels: run it without TRITON_INTERPRET=1")
os.environ["SPECSERVE_TRITON_AUTOTUNE"] = "0"  # one config per case; --all-configs compiles the others too

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import reference  # noqa: E402
from kernels import tree_attention as kernels  # noqa: E402
from kernels.metadata import AttentionMetadata  # noqa: E402
from specserve.tree import TokenTree  # noqa: E402


class CompileOnlyDriver:
    """What a launch asks of the driver before it compiles; nothing it would need to run."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


def compile_launches_only() -> None:
    """Every launch compiles its kernel (Triton's warm-up path) instead of running it."""
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_only


def random_tree(rng: random.Random, size: int) -> TokenTree:
    return TokenTree((1,) * size, (-1, *(rng.randrange(i) for i in range(1, size))))


def attention_case(tree_size: int, q_dtype: torch.dtype, cache: str, splits: int) -> None:
    rng = random.Random(tree_size)
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 16
    trees = [random_tree(rng, tree_size) for _ in range(2)]
    contexts = [300, 40]
    per_request = -(-(max(contexts) + tree_size) // block_size)
    tables = [list(range(r * per_request, (r + 1) * per_request)) for r in range(len(trees))]
    meta = AttentionMetadata.build(trees, contexts, tables, block_size, device="cpu")
    values = torch.randn(len(trees) * per_request, block_size, kv_heads, head_dim)
    k_cache, v_cache = (store(values, cache) for _ in range(2))
    q = torch.randn(meta.num_tokens, heads, head_dim, dtype=q_dtype)
    kernels.paged_tree_attention(q, k_cache, v_cache, meta, head_dim**-0.5, num_splits=splits)


def store(values: torch.Tensor, cache: str) -> torch.Tensor:
    """`values` as a `--kv-cache-dtype` pool holds them."""
    if cache == "int8":
        return reference.quantize_kv(values)
    return values.to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[cache])


def write_case(k_dtype: torch.dtype, cache: str) -> None:
    k, v = (torch.randn(5, 2, 64, dtype=k_dtype) for _ in range(2))
    k_cache, v_cache = (store(torch.zeros(4, 16, 2, 64), cache) for _ in range(2))
    kernels.write_kv(k, v, k_cache, v_cache, torch.tensor([3, 0, 17, -1, 40]))


def compact_case(cache: str) -> None:
    layers = store(torch.randn(2, 4, 16, 2, 64), cache)
    kernels.compact_kv(layers, torch.tensor([9, 12]), torch.tensor([5, 6]))


def cases(all_configs: bool) -> dict[str, Callable[[], None]]:
    out = {}
    for q_dtype, cache in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.bfloat16, "int8"),
                           (torch.float32, "int8"), (torch.bfloat16, "fp8"), (torch.float32, "fp8")):
        q_name = str(q_dtype).removeprefix("torch.")
        for tree_size, splits in ((1, 1), (1, 2), (16, 1), (16, 2), (80, 1)):
            name = f"attention q={q_name} cache={cache} tree={tree_size} splits={splits}"
            out[name] = lambda t=tree_size, d=q_dtype, c=cache, s=splits: attention_case(t, d, c, s)
        out[f"write_kv k={q_name} cache={cache}"] = lambda d=q_dtype, c=cache: write_case(d, c)
    for cache in ("fp32", "bf16", "int8", "fp8"):
        out[f"compact_kv cache={cache}"] = lambda c=cache: compact_case(c)
    if all_configs:
        os.environ["SPECSERVE_TRITON_AUTOTUNE"] = "1"
        tuned = kernels._attention_configs()
        os.environ["SPECSERVE_TRITON_AUTOTUNE"] = "0"
        for config in tuned:
            def one_config(config=config) -> None:
                kernels._tuned_attention.configs = [config]
                kernels._tuned_attention.cache.clear()
                attention_case(16, torch.bfloat16, "bf16", 1)
            out[f"attention config {config}"] = one_config
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    parser.add_argument("--all-configs", action="store_true", help="also every autotuning config of attention")
    args = parser.parse_args()
    driver.set_active(CompileOnlyDriver(args.arch))
    compile_launches_only()
    failed, todo = [], cases(args.all_configs)
    for name, case in todo.items():
        try:
            case()
            print(f"compiled  {name}", flush=True)
        except Exception:  # a compile error: report it and go on to the next case
            failed.append(name)
            print(f"FAILED    {name}\n{traceback.format_exc(limit=-3)}", flush=True)
    print(f"{len(failed)} of {len(todo)} cases failed to compile for sm_{args.arch}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
