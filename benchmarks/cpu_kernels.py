"""Weight-only quantized matmuls on this CPU: our kernel against the field's libraries.

For one projection shape (default: Qwen2.5-Coder-1.5B's MLP, 8960 x 1536, and SmolLM2's 1536 x
576), every candidate multiplies 1 to 64 rows (a decode, verification trees, batched decodes) by
a weight that is *not* in cache: each call takes the next of enough copies to fill several
times the last-level cache, as a forward streams its layers. Median microseconds per call after
warm-up, the candidates taking turns; at one row the bytes the candidate reads per second; and
its error against the exact product of the weights it was given (the fp32 weights rounded to
4-bit groups of 32 with fp16 scale and minimum, as a Q4_1 GGUF holds them): 0 for a candidate
that computes the GGUF's model up to its activation rounding.

Candidates (each where this machine can run it):
- ours, int4 / int8: `kernels/cpu` tiled kernels (activations int8 per 32 inputs, as llama.cpp's)
- torch fp32 (MKL) and bf16 (oneDNN) on the dequantized weights
- torch `_weight_int8pack_mm` (per-output-channel int8) and `_weight_int4pack_mm_for_cpu` (groups
  of 32, bf16 scales and zeros) with bf16 activations
- torchao 0.18's CPU configs (int8 weight-only; int8 dynamic activations) and zentorch's fp32
  linear, each run by this script inside a virtual environment of its own under the user cache

    python benchmarks/cpu_kernels.py [--shapes 8960x1536,1536x576] [--rows 1,2,4,8,16,32,64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
from report import write_report

RESULTS = Path(__file__).parent / "results"
CACHE_BYTES = 128 << 20  # copies of a weight cycled through: several times any L3 here
LIBRARIES = {"torchao": ["torchao==0.18.0", "numpy"], "zentorch": ["zentorch==2.13.0.1"]}


def q4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes 0..15, fp16 scale and minimum per 32 inputs (Q4_1's form), as fp32 tensors."""
    g = w.reshape(w.shape[0], -1, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8).half().float()
    minimum = lo.half().float()
    codes = ((g - minimum[..., None]) / scale[..., None]).round().clamp(0, 15)
    return codes, scale, minimum


def dequantized(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    return (codes * scale[..., None] + minimum[..., None]).reshape(codes.shape[0], -1)


Make = Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]  # exact weights -> x -> y


def project_candidates() -> dict[str, Make]:
    """The candidates of the project's own environment."""
    from specserve.models.gguf import BlockWeight

    def ours(bits: int) -> Make:
        def make(w: torch.Tensor):
            weight = BlockWeight.quantize(w, bits)
            weight.tiles()
            return weight.kernel()
        return make

    def plain(weight: torch.Tensor):
        return lambda x: torch.nn.functional.linear(x.to(weight.dtype), weight).float()

    def int8pack(w: torch.Tensor):
        scales = (w.abs().amax(1) / 127).clamp(min=1e-8)
        q = (w / scales[:, None]).round().clamp(-128, 127).to(torch.int8)
        s = scales.bfloat16()
        return lambda x: torch._weight_int8pack_mm(x.bfloat16(), q, s).float()

    def int4pack(w: torch.Tensor):
        codes, scale, minimum = q4_groups(w)  # w = (q - 8) * scale + zero, zero = minimum + 8 * scale
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.reshape(w.shape[0], -1).int(), 1)
        zeros = minimum + 8 * scale
        scale_zeros = torch.stack([scale.t(), zeros.t()], dim=-1).bfloat16().contiguous()
        return lambda x: torch._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, scale_zeros).float()

    return {
        "ours int4": ours(4),
        "ours int8": ours(8),
        "torch fp32 (MKL)": lambda w: plain(w.clone()),
        "torch bf16 (oneDNN)": lambda w: plain(w.bfloat16()),
        "torch int8pack (bf16 x)": int8pack,
        "torch int4pack (bf16 x)": int4pack,
    }


def library_candidates(library: str) -> dict[str, Make]:
    """The candidates a library's own environment runs (this script, re-run there)."""
    if library == "torchao":
        # torchao 0.18's wheel has no CPU kernels of its own (its da8w4 CPU layout is gone from
        # the API): its CPU configs run torch's ops, int8 weight-only and int8 x int8 dynamic
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

        def config(make_config) -> Make:
            def make(w: torch.Tensor):
                linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(torch.bfloat16)
                linear.weight.data.copy_(w)
                quantize_(linear, make_config())
                return lambda x: linear(x.bfloat16()).float()
            return make
        return {"torchao int8 weight-only (bf16 x)": config(Int8WeightOnlyConfig),
                "torchao int8 dynamic (int8 x)": config(Int8DynamicActivationInt8WeightConfig)}
    if library == "zentorch":
        import zentorch  # noqa: F401 - registers torch.ops.zentorch

        def fp32(w: torch.Tensor):
            weight = w.clone()
            return lambda x: torch.ops.zentorch.zentorch_linear_unary(x, weight)
        return {"zentorch fp32": fp32}
    raise ValueError(f"unknown library {library!r}")


def measure(candidates: dict[str, Make], shapes: list[tuple[int, int]], rows: list[int], repeats: int,
            seed: int = 0) -> list[dict]:
    """Per shape, candidate and row count: median seconds per call (cold weights), error, bytes."""
    records = []
    for n, k in shapes:
        generator = torch.Generator().manual_seed(seed)
        w = torch.randn(n, k, generator=generator) * 0.02
        exact = dequantized(*q4_groups(w))
        xs = {m: torch.randn(m, k, generator=generator) for m in rows}
        for name, make in candidates.items():
            try:
                first = make(exact)
                probe = first(xs[rows[0]])
            except Exception as e:  # noqa: BLE001 - a library that cannot run here is reported, not fatal
                records.append({"shape": [n, k], "candidate": name, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            copies = [first] + [make(exact) for _ in range(max(0, CACHE_BYTES // max(1, _bytes(first, exact)) - 1))]
            del probe
            for m in rows:
                x = xs[m]
                reference = x @ exact.t()
                result = first(x)
                error = float((result - reference).abs().max() / reference.abs().max())
                for call in copies:  # warm-up: every copy once
                    call(x)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    for call in copies:
                        call(x)
                    times.append((time.perf_counter() - start) / len(copies))
                records.append({"shape": [n, k], "candidate": name, "rows": m, "seconds": statistics.median(times),
                                "relative_error": error, "copies": len(copies)})
    return records


def _bytes(call, exact: torch.Tensor) -> int:
    """Bytes the candidate's weight tensors hold (closure cells and bound tensors)."""
    seen, total = set(), 0

    def visit(obj, depth: int = 0):
        nonlocal total
        if depth > 3 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                visit(item, depth + 1)
        elif isinstance(obj, torch.nn.Module):
            for t in obj.state_dict().values():
                visit(t, depth + 1)
        elif callable(obj):
            for cell in getattr(obj, "__closure__", None) or ():
                visit(cell.cell_contents, depth + 1)
            for value in (getattr(obj, "__defaults__", None) or ()):
                visit(value, depth + 1)
    visit(call)
    return total or exact.numel() * exact.element_size()


def run_library(library: str, args: argparse.Namespace) -> list[dict]:
    """This script inside the library's own venv (installed once), its records back."""
    import peer_envs

    python = peer_envs.ensure(f"kernels-{library}", [peer_envs.TORCH, *LIBRARIES[library]])
    out = subprocess.run([str(python), __file__, "--library", library, "--shapes", args.shapes, "--rows", args.rows,
                          "--repeats", str(args.repeats)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if out.returncode != 0:
        return [{"candidate": library, "error": out.stderr.strip().splitlines()[-1][:300] if out.stderr else "failed"}]
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8960x1536,1536x576")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--libraries", default="torchao,zentorch", help="'' for the project's candidates only")
    parser.add_argument("--library", help=argparse.SUPPRESS)  # set when re-run inside a library's venv
    parser.add_argument("--out", default=str(RESULTS / "cpu-kernels"))
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    if args.library:
        print(json.dumps(measure(library_candidates(args.library), shapes, rows, args.repeats)))
        return

    from tqdm import tqdm

    from specserve.machine import processor_name

    records = measure(project_candidates(), shapes, rows, args.repeats)
    for library in tqdm([x for x in args.libraries.split(",") if x], desc="libraries"):
        records += run_library(library, args)
    write_results(args.out, records, shapes, rows, processor_name())


def write_results(out: str, records: list[dict], shapes, rows: list[int], machine: str) -> None:
    table, failed = [], []
    for n, k in shapes:
        names = list(dict.fromkeys(r["candidate"] for r in records if r.get("shape") == [n, k] and "rows" in r))
        for name in names:
            mine = {r["rows"]: r for r in records
                    if r.get("shape") == [n, k] and r["candidate"] == name and "rows" in r}
            one = mine.get(1)
            table.append([f"{n}x{k}", name, *[f"{mine[m]['seconds'] * 1e6:.0f}" if m in mine else "-" for m in rows],
                          f"{mine[rows[-1]]['seconds'] / one['seconds']:.1f}x" if one and rows[-1] in mine else "-",
                          f"{max(r['relative_error'] for r in mine.values()):.1e}"])
    failed = [f"{r['candidate']}: {r['error']}" for r in records if "error" in r]
    caption = (f"Weight-only matmuls on `{machine}`, {torch.get_num_threads()} threads, weights cycled through "
               f"{CACHE_BYTES >> 20} MiB of copies (not in cache); median microseconds per call by rows; last "
               f"columns: {rows[-1]} rows over 1 row, and the largest error relative to the exact product of the "
               f"4-bit-group weights")
    if failed:
        caption += ". Could not run here: " + "; ".join(failed)
    write_report(out, {"benchmark": "cpu_kernels", "machine": machine, "threads": torch.get_num_threads(),
                       "records": records}, caption,
                 ["shape", "candidate", *[f"{m} rows" for m in rows], f"{rows[-1]} / 1", "error"], table)


if __name__ == "__main__":
    main()
