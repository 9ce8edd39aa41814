"""The engine end to end on real prompts (Spec-Bench questions, chat-formatted).

(a) Batch-1 decode speed against `transformers.generate` on the same weights and dtype. Both
    generate N tokens greedily (EOS ignored) from the same prompt; the decode rate is
    (N - 1) / (time for N tokens - time for 1 token), so prefill and start-up cancel out.
    Runs are interleaved, after warm-up; medians of the repeats.
(b) Aggregate throughput with C concurrent requests (all submitted at once, different
    prompts, N tokens each): generated tokens / wall time, and the ratio to C = 1.
(c) Per-request TTFT and TPOT percentiles at each concurrency.

`--memory-bound` runs another case instead: many long requests (prompts of several questions
and their replies: `--request-tokens` each) from more clients than the KV pool holds, against engines
that differ only in the pool's dtype (`--kv-cache-dtypes`, default bf16 vs int8), in the same
`--kv-cache-memory`, stepped in turn for `--steps` steps each. Per dtype: the requests the
scheduler runs at once (its running count after each step, mean over the second half of the
steps: by then the first requests have finished and their clients sent the next, the closed
loop's steady state), its preemptions and aggregate generated tok/s. `--schedule-conservativeness
0,1` also compares admission that keeps room for the running requests' growth (1, the default)
with admission on a prompt's first chunk alone (0, vLLM's way). Replies are long (half of each
request by default) so that the pool, not the step's token budget, bounds the running count: with
short replies a request finishes before the budget's prompt chunks have filled a large pool, and
both dtypes run what prefill keeps up with.

    python benchmarks/engine.py [--model smollm2-135m-instruct] [--quantization auto] [--repeats 3]
    python benchmarks/engine.py --memory-bound [--kv-cache-memory 768MiB] [--request-tokens 2048] [--steps 3000]
                                [--kv-cache-dtypes bf16,int8] [--schedule-conservativeness 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from report import write_report
from tqdm import tqdm

from specserve.ablation.config import SPEC_BENCH
from specserve.ablation.config import spec_bench_by_category as spec_bench_questions
from specserve.closed_loop import ClosedLoop, run_to_completion
from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.machine import processor_name
from specserve.pull import resolve_model
from specserve.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results"


def load_prompts(engine: LLMEngine, questions: Path, count: int, max_prompt_tokens: int) -> list[list[int]]:
    """The first `count` questions (round-robin over categories) that fit `max_prompt_tokens`."""
    by_category = spec_bench_questions(questions)
    prompts: list[list[int]] = []
    for i in range(max(map(len, by_category.values()))):
        for turns in by_category.values():
            if i < len(turns) and len(prompts) < count:
                ids = engine.encode(turns[i], chat=True)
                if len(ids) <= max_prompt_tokens:
                    prompts.append(ids)
    return prompts


def cpu_ticks() -> list[int]:
    """The machine's CPU time counters (`/proc/stat`: user, nice, system, idle, iowait, irq,
    softirq, steal, ...); empty where there is no /proc."""
    try:
        with open("/proc/stat") as stat:
            return [int(x) for x in stat.readline().split()[1:]]
    except OSError:
        return []


def steal_share(before: list[int], after: list[int]) -> float:
    """The share of CPU time the hypervisor took from this VM between two `cpu_ticks()`."""
    deltas = [b - a for a, b in zip(before, after, strict=False)]
    return deltas[7] / sum(deltas) if len(deltas) > 7 and sum(deltas) > 0 else 0.0


def run_interleaved(loops: list[ClosedLoop]) -> None:
    """Run several engines' loops to completion, one step of each in turn. Each is timed by its
    own `busy_s`: a machine whose speed drifts (other VMs on the host, clocks) slows all of
    them alike, where back-to-back runs seconds apart see different machines."""
    while not all(loop.done for loop in loops):
        for loop in loops:
            if not loop.done:
                loop.step()


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit all prompts at once and run to completion; wall time and per-request latencies."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    finished, start, wall = run_to_completion(engine, prompts, params)
    ttft = [o.metrics.first_token_time - start for o in finished]
    tpot = [(o.metrics.finish_time - o.metrics.first_token_time) / max(1, len(o.outputs[0].token_ids) - 1)
            for o in finished]
    tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    return {"wall_s": wall, "tokens": tokens, "ttft_s": ttft, "tpot_s": tpot}


def hf_generate_time(model, prompt: list[int], max_tokens: int) -> float:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                       min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def batch1_decode(engine: LLMEngine, hf, prompt: list[int], max_tokens: int, repeats: int) -> dict:
    rates: dict[str, list[float]] = {"specserve": [], "transformers": []}
    for _ in tqdm(range(repeats), desc="batch-1 decode", unit="rep"):
        ours = run_engine(engine, [prompt], max_tokens)["wall_s"] - run_engine(engine, [prompt], 1)["wall_s"]
        theirs = hf_generate_time(hf, prompt, max_tokens) - hf_generate_time(hf, prompt, 1)
        rates["specserve"].append((max_tokens - 1) / ours)
        rates["transformers"].append((max_tokens - 1) / theirs)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    return {"tokens_per_s": medians, "runs": rates, "speedup": medians["specserve"] / medians["transformers"]}


def long_prompts(engine: LLMEngine, questions: Path, count: int, prompt_tokens: int) -> list[list[int]]:
    """`count` prompts of about `prompt_tokens` tokens: Spec-Bench questions one after another, each
    prompt starting at a different one (so no two share a prefix), then asked to answer them all."""
    turns = [t for ts in spec_bench_questions(questions).values() for t in ts]
    prompts = []
    for first in range(count):
        parts: list[str] = []
        for turn in turns[first:] + turns[:first]:
            if len(engine.encode("\n\n".join(parts + [turn]), chat=True)) > prompt_tokens:
                break
            parts.append(turn)
        prompts.append(engine.encode("Answer each of these in turn.\n\n" + "\n\n".join(parts), chat=True))
    return prompts


def memory_bound(args: argparse.Namespace, path: Path) -> None:
    """Aggregate tok/s and requests running at once per engine setting (KV pool dtype x admission's
    conservativeness), in the same pool bytes."""
    settings = [(kv, float(c)) for kv in args.kv_cache_dtypes.split(",")
                for c in args.schedule_conservativeness.split(",")]
    names = [_setting_name(kv, c, args) for kv, c in settings]
    engines = {name: LLMEngine(path, args.dtype, EngineConfig(
        kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=kv, quantization=args.quantization,
        max_num_seqs=args.clients, enable_prefix_caching=False, speculation="off", schedule_conservativeness=c))
        for name, (kv, c) in zip(names, settings, strict=True)}
    first = engines[names[0]]
    prompts = long_prompts(first, args.questions, args.clients, args.request_tokens - args.reply_tokens)
    reply = args.request_tokens - max(map(len, prompts))
    params = SamplingParams(temperature=0, max_tokens=reply, ignore_eos=True)
    for engine in engines.values():  # warm-up (each engine's first steps also build its kernels)
        run_engine(engine, prompts[:2], 4)
    loops = {name: ClosedLoop(engine, prompts, params, concurrency=args.clients, steps=args.steps)
             for name, engine in engines.items()}
    running: dict[str, list[int]] = {name: [] for name in names}
    with tqdm(total=args.steps * len(names), desc="memory-bound", unit="step") as bar:
        while not all(loop.done for loop in loops.values()):
            for name, loop in loops.items():
                if not loop.done:
                    loop.step()
                    if not loop.done:  # the last step ends in aborting whatever still runs
                        running[name].append(len(engines[name].scheduler.running))
                    bar.update()
    per: dict[str, dict] = {}
    for (name, loop), (_, c) in zip(loops.items(), settings, strict=True):
        engine = engines[name]
        steady = running[name][len(running[name]) // 2:]
        per[name] = {"kv_cache_dtype": engine.info["kv_cache_dtype"], "schedule_conservativeness": c,
                     "kv_tokens": engine.num_kv_tokens, "running_mean": statistics.mean(steady),
                     "running_median": statistics.median(steady), "running_max": max(running[name]),
                     "finished": len(loop.finished), "tokens": loop.generated, "busy_s": loop.busy_s,
                     "tokens_per_s": loop.generated / loop.busy_s, "preemptions": engine.scheduler.num_preemptions}
    base = per[names[0]]
    rows = [[name, f"{v['kv_cache_dtype']}", f"{v['kv_tokens']:,}", f"{v['kv_tokens'] / base['kv_tokens']:.2f}x",
             f"{v['running_mean']:.1f} (median {v['running_median']:g}, max {v['running_max']})",
             f"{v['running_mean'] / base['running_mean']:.2f}x", str(v["preemptions"]), str(v["finished"]),
             f"{v['tokens_per_s']:.1f}", f"{v['tokens_per_s'] / base['tokens_per_s']:.2f}x"] for name, v in per.items()]
    caption = (f"Memory-bound serving: {args.model} ({first.info['weights']}, {first.info['dtype']} activations, "
               f"{processor_name()}, {torch.get_num_threads()} threads), {args.clients} closed-loop clients of "
               f"{min(map(len, prompts))}-{max(map(len, prompts))}-token prompts and {reply}-token greedy replies "
               f"(requests of up to {args.request_tokens} tokens), --kv-cache-memory {args.kv_cache_memory}, no "
               f"prefix caching, no speculation, engines stepped in turn for {args.steps} steps each. Running: the "
               f"scheduler's running count after each step, mean (and median) over the second half of the steps "
               f"(the steady state: the first requests have finished and their clients sent the next). "
               f"Preemptions: sequences preempted for blocks (each computed again from its first token).")
    write_report(args.out, {"model": args.model, "machine": processor_name(), "clients": args.clients,
                            "kv_cache_memory": args.kv_cache_memory, "request_tokens": args.request_tokens,
                            "prompt_tokens": [len(p) for p in prompts], "reply_tokens": reply,
                            "threads": torch.get_num_threads(), "per_setting": per, "running": running},
                 caption, ["engine", "pool", "KV tokens", "vs first", "running at once", "vs first", "preemptions",
                           "finished", "tok/s", "vs first"], rows)
    plot_running(running, f"{args.out}.png")


def _setting_name(kv: str, conservativeness: float, args: argparse.Namespace) -> str:
    """`--kv-cache-dtype bf16`, with the conservativeness where several are compared."""
    name = f"--kv-cache-dtype {kv}"
    if "," in args.schedule_conservativeness:
        name += f" --schedule-conservativeness {conservativeness:g}"
    return name


def plot_running(running: dict[str, list[int]], path: str) -> None:
    """The running count after every step, one line per engine setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5 + 0.25 * len(running)))
    for name, counts in running.items():
        ax.plot(range(1, len(counts) + 1), counts, label=name)
    ax.axvline(len(next(iter(running.values()))) // 2, color="grey", linestyle=":", label="steady state from here")
    ax.set_xlabel("engine step")
    ax.set_ylabel("requests running")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize="small")  # below: the lines fill the axes
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none"],
                        help="auto: a GGUF's own blocks (fp32 activations); none: plain weights in --dtype")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default: float32 (transformers too); bfloat16 serves plain weights")
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH, help="Spec-Bench questions (jsonl)")
    parser.add_argument("--out", default=None, help="default: results/engine or results/engine-memory-bound")
    parser.add_argument("--memory-bound", action="store_true", help="run the memory-bound case (above) instead")
    parser.add_argument("--kv-cache-dtypes", default="bf16,int8", help="memory-bound: the pools compared")
    parser.add_argument("--kv-cache-memory", default="768MiB", help="memory-bound: every engine's KV pool")
    parser.add_argument("--clients", type=int, default=64, help="memory-bound: closed-loop clients")
    parser.add_argument("--request-tokens", type=int, default=2048, help="memory-bound: prompt + reply tokens")
    parser.add_argument("--reply-tokens", type=int, default=1024, help="memory-bound: about this many replied")
    parser.add_argument("--steps", type=int, default=3000, help="memory-bound: steps per engine")
    parser.add_argument("--schedule-conservativeness", default="1",
                        help="memory-bound: admission's, one engine per value and dtype (0: admit on the first "
                             "prompt chunk, vLLM's way)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.memory_bound:
        args.out = args.out or str(RESULTS / "engine-memory-bound")
        return memory_bound(args, resolve_model(args.model))
    args.out = args.out or str(RESULTS / "engine")

    from specserve.models.loader import load_transformers

    path = resolve_model(args.model)
    levels = [int(c) for c in args.concurrency.split(",")]
    engine = LLMEngine(path, args.dtype, EngineConfig(max_num_seqs=max(levels), kv_cache_memory="2GiB",
                                                      quantization=args.quantization))
    hf = load_transformers(path, getattr(torch, args.dtype or "float32"))
    prompts = load_prompts(engine, args.questions, max(levels), args.max_prompt_tokens)

    # Warm-up: every batch shape the runs below will see, both engines.
    run_engine(engine, prompts[: max(levels)], 8)
    hf_generate_time(hf, prompts[0], 8)
    decode = batch1_decode(engine, hf, prompts[0], args.max_tokens, args.repeats)

    concurrency: dict[int, dict] = {}
    for c in tqdm(levels, desc="concurrency", unit="level"):
        runs = [run_engine(engine, prompts[:c], args.max_tokens) for _ in range(args.repeats)]
        best = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]  # the median run
        concurrency[c] = {
            "tokens_per_s": best["tokens"] / best["wall_s"],
            "runs_tokens_per_s": [r["tokens"] / r["wall_s"] for r in runs],
            "ttft_s": percentiles(best["ttft_s"]),
            "tpot_s": percentiles(best["tpot_s"]),
        }
    base = concurrency[levels[0]]["tokens_per_s"]
    for c in levels:
        concurrency[c]["vs_batch1"] = concurrency[c]["tokens_per_s"] / base

    result = {
        "model": args.model, "dtype": str(engine.model.dtype), "weights": engine.info["weights"],
        "kernels": engine.info["kernels"], "max_tokens": args.max_tokens, "repeats": args.repeats,
        "prompt_tokens": [len(p) for p in prompts], "threads": torch.get_num_threads(),
        "machine": processor_name(), "batch1_decode": decode,
        "concurrency": {str(c): v for c, v in concurrency.items()},
    }
    ms = 1000
    rows = [[
        str(c), f"{v['tokens_per_s']:.1f}", f"{v['vs_batch1']:.2f}x",
        f"{v['ttft_s']['p50'] * ms:.0f} / {v['ttft_s']['p90'] * ms:.0f} / {v['ttft_s']['p99'] * ms:.0f}",
        f"{v['tpot_s']['p50'] * ms:.1f} / {v['tpot_s']['p90'] * ms:.1f} / {v['tpot_s']['p99'] * ms:.1f}",
    ] for c, v in concurrency.items()]
    t = decode["tokens_per_s"]
    caption = (
        f"Engine on {args.model} ({engine.info['weights']}, {engine.info['dtype']} activations, kernels "
        f"{engine.info['kernels']}, {processor_name()}, {torch.get_num_threads()} threads), "
        f"{args.max_tokens} greedy tokens "
        f"per request, Spec-Bench prompts of {min(result['prompt_tokens'])}-{max(result['prompt_tokens'])} tokens, "
        f"median of {args.repeats}.\n\nBatch-1 decode: specserve {t['specserve']:.1f} tok/s vs transformers.generate "
        f"{t['transformers']:.1f} tok/s = **{decode['speedup']:.2f}x**.\n\nAggregate throughput, all requests "
        f"submitted at once (TTFT/TPOT p50 / p90 / p99 in ms):"
    )
    write_report(args.out, result, caption, ["concurrent", "tok/s", "vs 1", "TTFT ms", "TPOT ms"], rows)


if __name__ == "__main__":
    main()
