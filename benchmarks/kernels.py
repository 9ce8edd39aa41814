"""Tree attention on a CUDA GPU: the Triton kernel against SDPA with a dense mask and the reference.

For each batch x context x tree size, every request has the same cached context and one
token tree (1 node = decode; 16 and 64 nodes = random draft trees). Contenders, timed
interleaved on the same inputs with `triton.testing.do_bench` (median, after warm-up):

* kernel: `kernels.tree_attention.paged_tree_attention`, reading K/V through the block tables;
* sdpa: `F.scaled_dot_product_attention` over K/V already gathered into contiguous tensors
  with a materialised dense additive mask (gather not timed: the most favourable setting
  for SDPA), the faster of `enable_gqa=True` on `[B, Hkv, L, D]` and K/V repeated per
  query head beforehand;
* reference: `kernels.reference.paged_tree_attention` (block gather + mask + SDPA: the CPU path);
* kernel over quantized caches (`--kv-dtypes`, default int8 and fp8): the same K/V quantized as
  `--kv-cache-dtype int8|fp8` stores them (fp8 where the GPU has it), its time and bandwidth
  against the bf16 cache's, and its error against the reference over the dequantized values.

Bandwidth counts the K/V bytes each request must read once, over the kernel's time, as a
fraction of a device-to-device copy measured in the same run (bytes read + written) and of
the datasheet figure where the device is known.

    python benchmarks/kernels.py [--batches 1 8 32 64] [--contexts 512 2048 8192] [--trees 1 16 64]

`--device cpu` runs the same script with the kernel in Triton's interpreter: a smoke test of
the script on small shapes, not a measurement of the kernel.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# This script shares its name with the `kernels` package: take its folder off the import path
# so `import kernels` finds the package, then put it back (last) for `report`.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.metadata import AttentionMetadata  # noqa: E402
from specserve.machine import processor_name  # noqa: E402
from specserve.tree import TokenTree  # noqa: E402

sys.path.append(str(HERE))
from report import write_report  # noqa: E402

RESULTS = HERE / "results"
DATASHEET_TBPS = {"H200": 4.8, "H100 80GB HBM3": 3.35, "H100": 3.35, "A100": 2.0}


def datasheet_bandwidth(name: str) -> float | None:
    """Peak HBM bandwidth in bytes/s from the vendor's datasheet, by device name."""
    for key, tbps in DATASHEET_TBPS.items():
        if key in name:
            return tbps * 1e12
    return None


def timer(device: str, rep_ms: int) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of a call: CUDA events via do_bench on a GPU, perf_counter on a CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")

    def cpu_time(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cpu_time


def measured_copy_bandwidth(device: str, time_ms) -> float:
    """Bytes read + written per second by a large device-to-device copy (2 GiB on a GPU)."""
    src = torch.empty(2**30 if device == "cuda" else 2**26, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def draft_tree(rng: random.Random, size: int) -> TokenTree:
    """A draft tree's shape: each node hangs under a random earlier node (wide near the root)."""
    if size == 1:
        return TokenTree.single(1)
    parents = (-1,) + tuple(rng.randrange(max(1, i // 2)) for i in range(1, size))
    return TokenTree((1,) * size, parents)


def make_case(batch: int, context: int, tree_size: int, args, seed: int, device: str):
    rng = random.Random(seed)
    trees = [draft_tree(rng, tree_size) for _ in range(batch)]
    per_request = -(-(context + tree_size) // args.block_size)
    num_blocks = batch * per_request
    order = list(range(num_blocks))
    rng.shuffle(order)  # scattered blocks, as a long-running server's pool looks
    tables = [order[b * per_request : (b + 1) * per_request] for b in range(batch)]
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    meta = AttentionMetadata.build(trees, [context] * batch, tables, args.block_size, device=device)
    q = torch.randn(meta.num_tokens, args.heads, args.head_dim, dtype=torch.bfloat16, device=device)
    return q, k_cache, v_cache, meta


def quantize_cache(cache: torch.Tensor, dtype: str) -> torch.Tensor:
    """A bf16 cache as `--kv-cache-dtype int8|fp8` stores the same values."""
    return reference.quantize_kv(cache) if dtype == "int8" else cache.to(torch.float8_e4m3fn)


def sdpa_dense(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """SDPA's inputs prepared outside the timing: contiguous K/V, padded queries, a dense mask."""
    batch, n, seq = meta.num_requests, meta.max_tree_len, meta.max_seq_len
    heads, kv_heads, dim = q.shape[1], k_cache.shape[2], q.shape[2]
    blocks = meta.block_tables[:, : -(-seq // meta.block_size)].flatten()
    keys = k_cache.index_select(0, blocks).view(batch, -1, kv_heads, dim)[:, :seq].transpose(1, 2).contiguous()
    values = v_cache.index_select(0, blocks).view(batch, -1, kv_heads, dim)[:, :seq].transpose(1, 2).contiguous()
    queries = q.view(batch, n, heads, dim).transpose(1, 2).contiguous()  # all trees the same size here
    mask = meta.additive_key_mask(q.dtype).contiguous()
    groups = heads // kv_heads
    keys_expanded, values_expanded = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)

    def gqa():
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)

    def expanded():  # K/V repeated per query head beforehand: lets SDPA pick its mask-capable fused kernel
        return F.scaled_dot_product_attention(queries, keys_expanded, values_expanded, attn_mask=mask, scale=scale)

    return gqa, expanded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--trees", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time per contender and shape")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kv-dtypes", nargs="*", default=["int8", "fp8"], choices=["int8", "fp8"],
                        help="quantized caches the kernel also runs over (fp8: GPUs with compute capability 8.9+)")
    parser.add_argument("--out", default=str(RESULTS / "kernels"))
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
        print("no GPU: running the kernel through Triton's interpreter (a smoke test, not a measurement)")
    import triton

    from kernels import tree_attention as kernel

    time_ms = timer(args.device, args.rep_ms)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({processor_name()})"
    copy_bw = measured_copy_bandwidth(args.device, time_ms)
    sheet_bw = datasheet_bandwidth(device) if args.device == "cuda" else None
    scale = args.head_dim**-0.5
    shapes = [(b, c, t) for b in args.batches for c in args.contexts for t in args.trees]
    has_fp8 = args.device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    kv_dtypes = [d for d in args.kv_dtypes if d != "fp8" or has_fp8]
    rows, records = [], []
    for batch, context, tree_size in tqdm(shapes, desc="shapes"):
        seed = batch * 7 + context + tree_size
        q, k_cache, v_cache, meta = make_case(batch, context, tree_size, args, seed, args.device)
        sdpa_gqa, sdpa_expanded = sdpa_dense(q, k_cache, v_cache, meta, scale)
        contenders = {
            "kernel": lambda q=q, k=k_cache, v=v_cache, m=meta: kernel.paged_tree_attention(q, k, v, m, scale),
            "sdpa_gqa": sdpa_gqa,
            "sdpa_expanded": sdpa_expanded,
            "reference": lambda q=q, k=k_cache, v=v_cache, m=meta: reference.paged_tree_attention(q, k, v, m, scale),
        }
        expected = contenders["reference"]().float()
        error = (contenders["kernel"]().float() - expected).abs().max().item()  # also autotunes
        quantized_error, quantized_bytes = {}, {}
        for name in kv_dtypes:
            k_q, v_q = (quantize_cache(c, name) for c in (k_cache, v_cache))
            contenders[f"kernel_{name}"] = run = (
                lambda q=q, k=k_q, v=v_q, m=meta: kernel.paged_tree_attention(q, k, v, m, scale))
            keys, values = (reference.dequantize_kv(c, torch.float32) for c in (k_q, v_q))
            exact = reference.paged_tree_attention(q.float(), keys, values, meta, scale)
            quantized_error[name] = (run().float() - exact).abs().max().item()
            quantized_bytes[name] = batch * (context + tree_size) * 2 * k_q[0, 0].nbytes  # one slot: all heads
        ms = {name: time_ms(fn) for name, fn in contenders.items()}
        ms["sdpa"] = min(ms["sdpa_gqa"], ms["sdpa_expanded"])  # SDPA's better way of doing GQA
        kv_bytes = batch * (context + tree_size) * args.kv_heads * args.head_dim * 2 * k_cache.element_size()
        bandwidth = kv_bytes / (ms["kernel"] * 1e-3)
        record = dict(batch=batch, context=context, tree=tree_size, ms=ms, kv_bytes=kv_bytes,
                      kernel_bytes_per_s=bandwidth, fraction_of_copy=bandwidth / copy_bw,
                      fraction_of_datasheet=None if sheet_bw is None else bandwidth / sheet_bw,
                      speedup_vs_sdpa=ms["sdpa"] / ms["kernel"], speedup_vs_reference=ms["reference"] / ms["kernel"],
                      max_abs_error=error,
                      quantized={name: dict(ms=ms[f"kernel_{name}"], kv_bytes=quantized_bytes[name],
                                            bytes_per_s=quantized_bytes[name] / (ms[f"kernel_{name}"] * 1e-3),
                                            vs_bf16=ms["kernel"] / ms[f"kernel_{name}"],
                                            max_abs_error=quantized_error[name]) for name in kv_dtypes})
        records.append(record)
        rows.append([str(batch), str(context), str(tree_size), f"{ms['kernel']:.3f}", f"{ms['sdpa']:.3f}",
                     f"{ms['reference']:.3f}", f"{record['speedup_vs_sdpa']:.2f}x",
                     f"{record['speedup_vs_reference']:.2f}x", f"{bandwidth / 1e12:.2f}",
                     f"{100 * record['fraction_of_copy']:.0f}%",
                     "-" if sheet_bw is None else f"{100 * record['fraction_of_datasheet']:.0f}%", f"{error:.1e}",
                     *(f"{ms[f'kernel_{n}']:.3f} ({record['quantized'][n]['vs_bf16']:.2f}x)" for n in kv_dtypes)])
        tqdm.write(" | ".join(rows[-1]))  # each row as measured: a run cut short still shows what it reached
        del q, k_cache, v_cache, meta, contenders, expected, sdpa_gqa, sdpa_expanded
        if args.device == "cuda":
            torch.cuda.empty_cache()

    untuned = os.environ.get("SPECSERVE_TRITON_AUTOTUNE") == "0"
    tuning = "one for every shape and cache dtype (SPECSERVE_TRITON_AUTOTUNE=0)" if untuned else "autotuned per shape"
    result = dict(device=device, copy_bytes_per_s=copy_bw, datasheet_bytes_per_s=sheet_bw,
                  torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                  config=vars(args), autotuned=not untuned, results=records)
    timing = "CUDA events, do_bench" if args.device == "cuda" else "perf_counter; interpreter smoke run"
    sheet = "unknown" if sheet_bw is None else f"{sheet_bw / 1e12:.2f} TB/s"
    caption = (f"Tree attention on {device}, bf16, {args.heads} query / {args.kv_heads} KV heads x {args.head_dim}, "
               f"block size {args.block_size}; median ms ({timing}). K/V bandwidth of the kernel against a "
               f"device-to-device copy measured in this run ({copy_bw / 1e12:.2f} TB/s) and the datasheet ({sheet}). "
               f"sdpa = dense-mask SDPA over pre-gathered K/V (gather untimed); reference = our torch path. "
               f"Kernel configs: {tuning}.")
    header = ["batch", "context", "tree", "kernel ms", "sdpa ms", "reference ms", "vs sdpa", "vs reference",
              "TB/s", "of copy", "of datasheet", "max err", *(f"{n} ms (vs bf16)" for n in kv_dtypes)]
    write_report(args.out, result, caption, header, rows)


if __name__ == "__main__":
    main()
