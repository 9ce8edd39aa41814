"""specserve on a GPU in one command (under 9 minutes on an H100): the tree-attention kernel, the
engine without speculation against transformers, and speculation at set acceptances.

1. Kernel: our Triton tree attention over the paged cache against torch SDPA with a dense tree
   mask over K/V gathered beforehand (not timed: the baseline at its best), and against SDPA's
   flash path for chains (lower-right causal); batch 1/8/32/128, context 512/2048/8192, trees of
   1/16/64 nodes, Llama-2-7B's heads in bf16, each timed over CUDA-graph replays (its GPU work,
   without the launch overhead a served step's graph does not pay). K/V bandwidth as a share of a
   device-to-device copy's, measured in the same run.
2. Engine, no speculation, dummy Llama-2-7B (`configs/models/llama-2-7b`, random bf16 weights):
   tok/s at batch 1/8/64/256 (128-token prompts, 128 tokens out) against transformers `generate`
   with a static cache on the same weights.
3. Speculation on the same engine: `replay:0.6` and `replay:0.8` (chains and 4-wide trees, adaptive
   budgets; each replay drafter first records the greedy continuations, see `drafters.replay`) and
   the dummy 160M draft model, batch 1 to 256: speed-up over no speculation at the same batch.
   Every row runs twice and the second is measured: the first compiles and tunes the kernels for
   its step shapes and records the replay continuations at the batch's own bf16 rounding.

Writes gpu.json, gpu.md and gpu.png to --out; prints the GPU, torch and Triton versions. Needs
torch, triton, numpy, safetensors, tqdm, transformers and matplotlib (no server packages).
`--smoke` runs tiny sizes anywhere (a CPU too) to check the script itself.

    python benchmarks/gpu.py --out results/gpu [--smoke]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import report  # noqa: F401 - first: puts the kernels package before this folder's kernels.py
import torch
import torch.nn.functional as F  # noqa: N812
from tqdm import tqdm

from kernels import ops
from kernels.metadata import AttentionMetadata
from specserve.llm import LLM
from specserve.models.config import ModelConfig
from specserve.models.dummy import dummy_tensors
from specserve.sampling import SamplingParams, SpeculationParams
from specserve.tree import TokenTree

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"
TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 1024, "bos_token_id": 1,
        "eos_token_id": 2}


def timed(fn: Callable[[], object], device: torch.device, warmup: int = 3, repeats: int = 10) -> float:
    """Median seconds of `fn` (synchronized on an accelerator)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_replays(fn: Callable[[], object], device: torch.device, repeats: int = 20) -> float:
    """Median seconds of `fn`'s GPU work alone: captured in a CUDA graph (after a warm-up that
    compiles and tunes it) and timed by events over its replays, so a launch's Python and driver
    overhead, which a served step's graph does not pay either, stays out. Elsewhere: `timed`."""
    if device.type != "cuda":
        return timed(fn, device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second a device-to-device copy moves (read + written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device)


def random_tree(nodes: int, generator: torch.Generator) -> TokenTree:
    """A tree of `nodes` nodes, each hanging under a random earlier one (a chain for one node)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, nodes)]
    return TokenTree(tuple(range(3, 3 + nodes)), tuple(parents))


def kernel_case(batch: int, context: int, nodes: int, heads: int, head_dim: int, device: torch.device,
                dtype: torch.dtype, generator: torch.Generator) -> dict:
    block = 16
    per_request = -(-(context + nodes) // block)
    shape = (batch * per_request, block, heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    tables = [list(range(b * per_request, (b + 1) * per_request)) for b in range(batch)]
    trees = [random_tree(nodes, generator) for _ in range(batch)]
    meta = AttentionMetadata.build(trees, [context] * batch, tables, block, device)
    q = torch.randn(batch * nodes, heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    ours = timed_replays(lambda: ops.paged_tree_attention(q, k_cache, v_cache, meta, scale), device)
    # The baselines read K/V already gathered per request: [batch, heads, context + nodes, head_dim]
    keys = context + nodes
    gather = torch.tensor(tables, device=device)
    kg = k_cache[gather].flatten(1, 2)[:, :keys].transpose(1, 2).contiguous()
    vg = v_cache[gather].flatten(1, 2)[:, :keys].transpose(1, 2).contiguous()
    qb = q.view(batch, nodes, heads, head_dim).transpose(1, 2)
    mask = torch.ones(batch, 1, nodes, keys, dtype=torch.bool, device=device)
    mask[:, 0, :, context:] = meta.ancestor_mask[:, :nodes, :nodes]
    masked = timed_replays(lambda: F.scaled_dot_product_attention(qb, kg, vg, attn_mask=mask, scale=scale), device)
    from torch.nn.attention.bias import causal_lower_right

    causal = causal_lower_right(nodes, keys) if nodes > 1 else None
    flash = timed_replays(lambda: F.scaled_dot_product_attention(qb, kg, vg, attn_mask=causal, scale=scale), device)
    kv_bytes = 2 * batch * keys * heads * head_dim * k_cache.element_size()
    return {"batch": batch, "context": context, "nodes": nodes, "ours_us": ours * 1e6, "sdpa_masked_us": masked * 1e6,
            "sdpa_chain_flash_us": flash * 1e6, "kv_bytes": kv_bytes}


def record(rows: list[dict], row: dict) -> None:
    """Keeps a measured row and prints it at once: a run cut short still shows what it measured."""
    rows.append(row)
    tqdm.write(json.dumps(row), file=sys.stdout)


class Deadline:
    """The run's time budget: sections stop starting new cases once it has passed (and say so)."""

    def __init__(self, seconds: float):
        self.end, self.missed = time.perf_counter() + seconds, []

    def over(self, case: str) -> bool:
        if time.perf_counter() < self.end:
            return False
        self.missed.append(case)
        return True


def kernel_rows(device: torch.device, smoke: bool, deadline: Deadline) -> tuple[list[dict], float]:
    heads, head_dim = (4, 16) if smoke else (32, 128)  # Llama-2-7B's
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    batches, contexts, trees = ((1, 2), (48,), (1, 4)) if smoke else ((1, 8, 32, 128), (512, 2048, 8192), (1, 16, 64))
    bandwidth = copy_bandwidth(device, (1 << 24) if smoke else (2 << 30))
    generator = torch.Generator().manual_seed(0)
    rows = []
    cases = [(b, c, n) for b in batches for c in contexts for n in trees]
    for batch, context, nodes in tqdm(cases, desc="kernel"):
        if deadline.over(f"kernel batch {batch} context {context} nodes {nodes}"):
            continue
        row = kernel_case(batch, context, nodes, heads, head_dim, device, dtype, generator)
        row["kv_share_of_copy"] = row["kv_bytes"] / (row["ours_us"] * 1e-6) / bandwidth
        record(rows, row)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, bandwidth


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (count, length), generator=generator).tolist()


def throughput(llm: LLM, batch: list[list[int]], params: SamplingParams) -> tuple[float, dict]:
    """Generated tokens per second for the batch at once, and the speculation counters of the run."""
    before = dict(vars(llm.engine.metrics.spec))
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = vars(llm.engine.metrics.spec)
    spec = {k: after[k] - before[k] for k in ("drafted_tokens", "accepted_tokens", "rejections", "verify_steps")}
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds, spec


def build_engine(target: Path, draft: Path, device: torch.device, smoke: bool, max_num_seqs: int, kv_cache_memory: str,
           enforce_eager: bool) -> LLM:
    return LLM(str(target), draft=str(draft), load_format="dummy", device=str(device),
               dtype="float32" if device.type == "cpu" else "bfloat16", speculation="adaptive",
               kv_cache_memory="256MiB" if smoke else kv_cache_memory, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max(512, max_num_seqs), enable_prefix_caching=False, enforce_eager=enforce_eager)


def engine_rows(target: Path, draft: Path, device: torch.device, smoke: bool, deadline: Deadline,
                enforce_eager: bool = False) -> list[dict]:
    batches = (1, 4) if smoke else (1, 8, 64, 256)
    length, out = (8, 16) if smoke else (128, 128)
    vocab = ModelConfig.from_dir(target).vocab_size
    work = prompts(max(batches), length, vocab)
    started = time.perf_counter()
    llm = build_engine(target, draft, device, smoke, max(batches), "30GiB", enforce_eager)
    tqdm.write(f"engine built in {time.perf_counter() - started:.1f} s (CUDA graphs captured unless eager)",
               file=sys.stdout)

    def params(spec: SpeculationParams) -> SamplingParams:
        return SamplingParams(max_tokens=out, temperature=0, ignore_eos=True, speculation=spec)

    configs = {
        "none": SpeculationParams(enabled=False),
        "replay:0.6 chain": SpeculationParams(drafter="replay:0.6", tree="chain", top_k=1),
        "replay:0.6 tree": SpeculationParams(drafter="replay:0.6", tree="tree", top_k=4),
        "replay:0.8 chain": SpeculationParams(drafter="replay:0.8", tree="chain", top_k=1),
        "replay:0.8 tree": SpeculationParams(drafter="replay:0.8", tree="tree", top_k=4),
        "draft 160M (dummy)": SpeculationParams(),
    }
    rows = []
    for batch in tqdm(batches, desc="engine"):
        for name, spec in configs.items():
            if deadline.over(f"engine batch {batch} {name}"):
                continue
            # An unmeasured pass first: it compiles and tunes the kernels for this batch's step shapes,
            # and records the replay drafters' continuations at this batch's own rounding (in bf16 a
            # random model's greedy path can change with the batch's matrix shapes).
            throughput(llm, work[:batch], params(spec))
            rate, counters = throughput(llm, work[:batch], params(spec))
            record(rows, {"batch": batch, "config": name, "tok_s": rate, **counters})
    del llm
    _free(device)
    if not enforce_eager and not deadline.over("engine without CUDA graphs"):  # what the graphs bring
        llm = build_engine(target, draft, device, smoke, max(batches), "8GiB", enforce_eager=True)
        throughput(llm, work[:2], params(configs["none"]))
        for batch in batches[:2]:
            rate, counters = throughput(llm, work[:batch], params(configs["none"]))
            record(rows, {"batch": batch, "config": "none, eager (no CUDA graphs)", "tok_s": rate, **counters})
        del llm
        _free(device)
    for batch in tqdm(batches, desc="transformers"):
        if deadline.over(f"transformers batch {batch}"):
            continue
        record(rows, {"batch": batch, "config": "transformers static cache",
                      "tok_s": transformers_rate(target, work[:batch], out, device)})
    return rows


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def transformers_rate(target: Path, batch: list[list[int]], out: int, device: torch.device) -> float | None:
    """transformers `generate` (greedy, static cache) on the dummy weights our engine served."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    config = ModelConfig.from_dir(target)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    hf_config = LlamaConfig(**json.loads((target / "config.json").read_text()))
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype on its device: a 7B model never in fp32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_config).eval()
    finally:
        torch.set_default_dtype(default)
    state = {("" if k.startswith("lm_head") else "model.") + k: v
             for k, v in dummy_tensors(config, dtype, device).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise RuntimeError(f"transformers' Llama does not take our dummy weights: {missing[:3]} {unexpected[:3]}")
    ids = torch.tensor(batch, device=device)

    def run() -> None:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out, min_new_tokens=out,
                       do_sample=False, cache_implementation="static", pad_token_id=0)

    seconds = timed(run, device, warmup=1, repeats=1)
    return len(batch) * out / seconds


def plot(path: Path, kernel: list[dict], engine: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for nodes in sorted({r["nodes"] for r in kernel}):
        for context in sorted({r["context"] for r in kernel}):
            rows = [r for r in kernel if r["nodes"] == nodes and r["context"] == context]
            left.plot([r["batch"] for r in rows], [r["sdpa_masked_us"] / r["ours_us"] for r in rows], marker="o",
                      label=f"{nodes} nodes, context {context}")
    left.axhline(1.0, color="grey", lw=0.8)
    left.set(xscale="log", xlabel="batch", ylabel="masked SDPA time / ours", title="tree attention")
    left.legend(fontsize=6)
    plain = {r["batch"]: r["tok_s"] for r in engine if r["config"] == "none"}
    for name in dict.fromkeys(r["config"] for r in engine):
        if name == "none":
            continue
        rows = [r for r in engine if r["config"] == name and r["tok_s"]]
        right.plot([r["batch"] for r in rows], [r["tok_s"] / plain[r["batch"]] for r in rows], marker="o", label=name)
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(xscale="log", xlabel="batch", ylabel="tok/s over specserve without speculation",
              title="engine (dummy Llama-2-7B)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for gpu.json, gpu.md and gpu.png")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device: checks the script runs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out: kernel, engine")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="the engine without CUDA graphs (default: with them, and a no-speculation run without)")
    parser.add_argument("--budget-s", type=float, default=480,
                        help="start no new case after this many seconds (the run must fit 9 minutes on an H100); "
                             "the kernel section gets a third of it")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda" and not args.smoke:
        sys.exit("benchmarks/gpu.py measures a GPU: run it on a CUDA machine (or pass --smoke to check it)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"device {gpu}, torch {torch.__version__}, triton {triton.__version__}")
    skip = set(filter(None, args.skip.split(",")))
    started = time.perf_counter()
    kernel_deadline, deadline = Deadline(args.budget_s / 3), Deadline(args.budget_s)
    kernel, bandwidth = kernel_rows(device, args.smoke, kernel_deadline) if "kernel" not in skip else ([], math.nan)
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            target = Path(tmp) / "tiny"
            target.mkdir()
            (target / "config.json").write_text(json.dumps(TINY))
            draft = Path(tmp) / "tiny-draft"
            draft.mkdir()
            (draft / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 1}))
        else:
            target, draft = MODELS / "llama-2-7b", MODELS / "llama-160m"
        engine = (engine_rows(target, draft, device, args.smoke, deadline, args.enforce_eager)
                  if "engine" not in skip else [])
    result = {"benchmark": "gpu", "device": gpu, "torch": torch.__version__, "triton": triton.__version__,
              "smoke": args.smoke, "copy_gb_per_s": bandwidth / 1e9, "kernel": kernel, "engine": engine,
              "not_run_for_time": kernel_deadline.missed + deadline.missed,
              "wall_s": time.perf_counter() - started}
    (out / "gpu.json").write_text(json.dumps(result, indent=2))
    plain = {r["batch"]: r["tok_s"] for r in engine if r["config"] == "none"}
    lines = [f"# specserve on {gpu} (torch {torch.__version__}, Triton {triton.__version__})", "",
             f"Tree attention, bf16, Llama-2-7B heads; device copy {bandwidth / 1e9:.0f} GB/s. Times in us.", "",
             "| batch | context | nodes | ours | masked SDPA | chain flash SDPA | masked / ours | K/V share of copy |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['context']} | {r['nodes']} | {r['ours_us']:.0f} | {r['sdpa_masked_us']:.0f} | "
              f"{r['sdpa_chain_flash_us']:.0f} | {r['sdpa_masked_us'] / r['ours_us']:.2f}x | "
              f"{r['kv_share_of_copy']:.0%} |" for r in kernel]
    lines += ["", "Engine on dummy Llama-2-7B (bf16), greedy, 128-token prompts, 128 tokens out: tok/s, and "
              "over specserve without speculation at the same batch.", "",
              "| batch | config | tok/s | over no speculation | drafted | acceptance per token |",
              "|---:|---|---:|---:|---:|---:|"]
    for r in engine:
        ratio = f"{r['tok_s'] / plain[r['batch']]:.2f}x" if r["tok_s"] and r["batch"] in plain else "-"
        drafted = r.get("drafted_tokens", 0)
        trials = r.get("accepted_tokens", 0) + r.get("rejections", 0)  # drafted tokens whose parent was accepted
        rate = f"{r['accepted_tokens'] / trials:.2f}" if trials else "-"
        lines.append(f"| {r['batch']} | {r['config']} | {r['tok_s']:.1f} | {ratio} | {drafted} | {rate} |"
                     if r["tok_s"] else f"| {r['batch']} | {r['config']} | - | - | - | - |")
    missed = kernel_deadline.missed + deadline.missed
    if missed:
        lines += ["", f"Not run, the time budget ({args.budget_s:.0f} s) spent: {'; '.join(missed)}."]
    (out / "gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if kernel and engine:
        plot(out / "gpu.png", kernel, engine)
    print(f"[{time.perf_counter() - started:.0f} s; {out}]")


if __name__ == "__main__":
    main()
