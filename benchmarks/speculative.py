"""Speculative decoding end to end: greedy, bf16, medians; every configuration side by side.

(a) Qwen2.5-Coder-1.5B target + 0.5B draft on Spec-Bench's 10 coding questions, 128 new
    tokens, batch 1: tok/s of transformers greedy, transformers assisted generation
    (`assistant_model=`), specserve without speculation, with a drafted chain and with a
    drafted tree. Per prompt the configurations run back to back (interleaved), after a
    warm-up of each; the median over prompts (x repeats) is reported.
(b) SmolLM2 with early exit and n-gram drafters on Spec-Bench (all 13 categories, first turn,
    64 new tokens, batch 1): speed-up over specserve without speculation and MAT, per category.
(c) SmolLM2 at 1, 8, 32 and 64 concurrent requests: aggregate tok/s with and without
    speculation (adaptive tree budgets) on two identical engines stepped in turn, each timed by
    its own steps; the median of the repeats' ratios. c closed-loop clients send Spec-Bench
    questions (round-robin over the categories) one after another, so c are always in flight,
    until each engine generated the tokens of 3 requests per client (at least 13 requests);
    `--drain` runs exactly those requests to completion instead. Request lengths vary (64
    +- 50%, the same per request number for both engines): with all equal, the clients finish
    in lockstep, and the plain engine prefills their next prompts together in a few steps,
    which no real traffic does and speculation (accepting different runs per request) breaks
    (two plain engines side by side were measurably slower with varied lengths than with equal
    ones).

(d) SmolLM2 with its trained heads (feature, early exit) against the untrained early exit,
    n-gram lookup and a merge, as (b) but 128 new tokens; means over the categories too.

EOS is ignored everywhere so that every run generates the same number of tokens.

    python benchmarks/speculative.py --parts a,b,c,d [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from engine import (  # benchmarks/engine.py
    SPEC_BENCH,
    cpu_ticks,
    load_prompts,
    run_interleaved,
    steal_share,
)
from engine import spec_bench_questions as questions
from report import write_report
from tqdm import tqdm

from specserve.closed_loop import ClosedLoop, run_to_completion
from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.machine import processor_name
from specserve.outputs import RequestOutput
from specserve.pull import resolve_model
from specserve.sampling import SamplingParams
from specserve.sequence import SpecStats

RESULTS = Path(__file__).parent / "results"


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, speculation: dict | None) -> dict:
    """All prompts at once to completion: wall time, tokens, and speculation counters."""
    first, ticks = engine.metrics.steps, cpu_ticks()
    outputs, _, wall = run_to_completion(engine, prompts, _params(max_tokens, speculation))
    return _measured(outputs, wall, engine.metrics.steps - first, steal_share(ticks, cpu_ticks()))


def side_by_side(engines: dict[str, LLMEngine], configs: dict[str, dict | None], prompts: list[list[int]],
                 max_tokens: int, concurrency: int, tokens: int | None = None,
                 spread: float = 0.0) -> dict[str, dict]:
    """Each configuration on its own engine over the same prompts from `concurrency` closed-loop
    clients, all at once, one engine step of each in turn; each timed by its own steps. With
    `tokens`: each until it generated that many, the clients never running out (`ClosedLoop`).
    With `spread`: request lengths vary by that share of `max_tokens` (`request_length`)."""
    loops = {name: ClosedLoop(engines[name], prompts,
                              lambda k, spec=spec: _params(request_length(k, max_tokens, spread), spec),
                              concurrency, tokens)
             for name, spec in configs.items()}
    first, ticks = {name: engine.metrics.steps for name, engine in engines.items()}, cpu_ticks()
    run_interleaved(list(loops.values()))
    steal = steal_share(ticks, cpu_ticks())
    return {name: _measured(loop.finished + loop.aborted, loop.busy_s, engines[name].metrics.steps - first[name],
                            steal, loop.generated) for name, loop in loops.items()}


def request_length(k: int, max_tokens: int, spread: float) -> int:
    """Request k's max_tokens: `max_tokens` give or take `spread` of it, uniformly, by a draw
    fixed per k (every engine gets the same lengths, so the same work)."""
    return max(1, round(max_tokens * (1 + spread * random.Random(k).uniform(-1.0, 1.0))))


def _params(max_tokens: int, speculation: dict | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, speculation=speculation)


def _measured(outputs: list[RequestOutput], seconds: float, steps: int, steal: float,
              tokens: int | None = None) -> dict:
    """`tokens`: generated in `seconds` (default: all of the outputs' tokens)."""
    spec = SpecStats()
    for o in outputs:
        spec.add(o.metrics.spec)
    if tokens is None:
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"wall_s": seconds, "tokens": tokens, "tok_s": tokens / seconds, "steps": steps,
            "mat": spec.mean_accepted_tokens, "drafted": spec.drafted_tokens, "accepted": spec.accepted_tokens,
            "verify_steps": spec.verify_steps, "steal": steal,
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- (a) Qwen target + draft against transformers -------------------------------------------------


def part_a(args) -> None:
    from specserve.models.loader import load_transformers

    target, draft = resolve_model(args.target), resolve_model(args.draft)
    engine = LLMEngine(target, "bfloat16", EngineConfig(draft=str(draft), speculation=args.speculation,
                                                         kv_cache_memory="1GiB", draft_vocab=args.draft_vocab or None,
                                                         draft_quantization=args.draft_quantization))
    dtype = torch.bfloat16
    hf = load_transformers(target, dtype)
    assistant = load_transformers(draft, dtype)
    prompts = [engine.encode(q, chat=True) for q in questions(args.questions)["coding"][: args.prompts]]
    drafter = engine.drafter
    shapes = {"chain": (1, 1, args.chain_tokens), "tree": (args.top_k, args.beam, args.tree_tokens)}

    def specserve(name: str, prompt: list[int], max_tokens: int) -> dict:
        if name == "no-spec":
            return run(engine, [prompt], max_tokens, {"enabled": False})
        drafter.top_k, drafter.beam, cap = shapes[name]
        return run(engine, [prompt], max_tokens, {"max_tree_tokens": cap})

    def hf_run(prompt: list[int], max_tokens: int, assisted: bool) -> dict:
        ids = torch.tensor([prompt])
        extra = {"assistant_model": assistant} if assisted else {}
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **extra)
        wall = time.perf_counter() - start
        return {"wall_s": wall, "tokens": out.shape[1] - len(prompt), "tok_s": (out.shape[1] - len(prompt)) / wall,
                "token_ids": [out[0, len(prompt):].tolist()]}

    contenders = {
        "transformers greedy": lambda p, n: hf_run(p, n, False),
        "transformers assisted": lambda p, n: hf_run(p, n, True),
        "specserve no-spec": lambda p, n: specserve("no-spec", p, n),
        "specserve chain": lambda p, n: specserve("chain", p, n),
        "specserve tree": lambda p, n: specserve("tree", p, n),
    }
    for fn in tqdm(contenders.values(), desc="(a) warm-up", unit="config"):
        fn(prompts[0], 8)
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for prompt in tqdm(prompts, desc="(a) prompts", unit="prompt"):
            for name, fn in contenders.items():
                runs[name].append(fn(prompt, args.max_tokens_a))
    summary = {name: {"tok_s": median([r["tok_s"] for r in rs]),
                      "mat": median([r["mat"] for r in rs if r.get("mat")]) if "chain" in name or "tree" in name
                      else None} for name, rs in runs.items()}
    base, assisted = summary["transformers greedy"]["tok_s"], summary["transformers assisted"]["tok_s"]
    plain = runs["specserve no-spec"]
    same = all(a["token_ids"] == b["token_ids"] for name in ("specserve chain", "specserve tree")
               for a, b in zip(plain, runs[name], strict=True))
    # bf16 logits depend on a forward's shape (matmul blocking, attention path), so near-ties can
    # flip between any two implementations: how long each agrees with specserve no-spec, as a
    # fraction of the tokens (transformers' own greedy is the yardstick for what is numerical).
    agreement = {name: statistics.mean(_common_prefix(a["token_ids"][0], b["token_ids"][0])
                                       / max(1, len(a["token_ids"][0])) for a, b in zip(plain, runs[name], strict=True))
                 for name in ("transformers greedy", "specserve chain", "specserve tree")}
    result = {"machine": _machine(), "target": args.target, "draft": args.draft, "prompts": len(prompts),
              "max_tokens": args.max_tokens_a, "repeats": args.repeats, "shapes": shapes,
              "draft_vocab": args.draft_vocab, "draft_quantization": args.draft_quantization,
              "speculation": args.speculation, "summary": summary, "identical_to_no_spec": same,
              "agreement_with_no_spec": agreement,
              "runs": {k: [{x: y for x, y in r.items() if x != "token_ids"} for r in v] for k, v in runs.items()}}
    rows = [[name, f"{s['tok_s']:.2f}", f"{s['tok_s'] / base:.2f}x", f"{s['tok_s'] / assisted:.2f}x",
             "" if s["mat"] is None else f"{s['mat']:.2f}"] for name, s in summary.items()]
    caption = (f"(a) {args.target} + {args.draft} draft, bfloat16, {torch.get_num_threads()} threads: "
               f"Spec-Bench coding ({len(prompts)} prompts), {args.max_tokens_a} new tokens, batch 1, median over "
               f"prompts x {args.repeats}. Chain: top-k 1, cap {shapes['chain'][2]}; tree: top-k {args.top_k}, "
               f"beam {args.beam}, cap {args.tree_tokens}; draft vocabulary {args.draft_vocab or 'all'}, "
               f"draft projections {args.draft_quantization}; "
               f"speculation {args.speculation}. Speculative tokens "
               f"identical to no-spec: {same}; mean share of tokens before the first difference from no-spec: "
               + ", ".join(f"{k} {v:.0%}" for k, v in agreement.items()) + ".")
    write_report(args.out + "-a", result, caption, ["config", "tok/s", "vs HF greedy", "vs HF assisted", "MAT"], rows)


# -- (b) SmolLM2 drafters per Spec-Bench category ---------------------------------------------------


def part_b(args) -> None:
    drafters = ["ngram", f"early-exit:{args.early_exit}", f"ngram+early-exit:{args.early_exit}"]
    per_category(args, "b", drafters, args.max_tokens_b)


def part_d(args) -> None:
    per_category(args, "d", [d.strip() for d in args.drafters_d.split(",")], args.max_tokens_d)


def per_category(args, part: str, drafters: list[str], max_tokens: int) -> None:
    """Each drafter against no speculation on the same engine, prompt by prompt (interleaved),
    at batch 1; speed-up and MAT per Spec-Bench category, and their means over categories.
    A drafter that learns across requests (`suffix`) drafts from the answers to the questions
    before, and with repeats from its own earlier answers to the same question: measure it with
    `--repeats 1` (or `suffix:0`, which keeps nothing across requests). All configurations that
    hold a suffix part share one cache, so a question's answer enters it only from the last of
    them to run that question (`share_output`): each drafts from the same earlier answers, never
    from another configuration's answer to the question it is answering.
    (Until `d` came, part b ran with prefix caching on, so every configuration after the first
    found its prompt cached: its long-prompt categories, summarization and rag, overstate.)"""
    parts = list(dict.fromkeys(p for d in drafters for p in d.split("+")))  # every part loads at start
    # No prefix caching: every configuration prefills its prompt, as the first one to run it would.
    engine = LLMEngine(resolve_model(args.model), args.dtype,
                       EngineConfig(draft="+".join(parts), speculation=args.speculation, kv_cache_memory="1GiB",
                                    max_tree_tokens=args.tree_tokens, draft_top_k=args.top_k, draft_beam=args.beam,
                                    enable_prefix_caching=False))
    configs = {"no-spec": {"enabled": False}, **{d: {"drafter": d} for d in drafters}}
    asked = questions(args.questions)
    by_category = {c: [engine.encode(q, chat=True) for q in qs[: args.per_category]] for c, qs in asked.items()}
    # Warm up on a question not measured: the suffix drafter keeps what it saw for later requests.
    warm_up = engine.encode(next(qs[-1] for qs in asked.values() if len(qs) > args.per_category), chat=True)
    for spec in configs.values():
        run(engine, [warm_up], 16, spec)
    runs: dict[str, dict[str, list[dict]]] = {c: {name: [] for name in configs} for c in by_category}
    sharing = [name for name in configs if "suffix" in name][-1:]
    for _ in range(args.repeats):
        for category, prompts in tqdm(by_category.items(), desc=f"({part}) categories", unit="category"):
            for prompt in prompts:
                for name, spec in configs.items():
                    shares = {"share_output": name in sharing} if "suffix" in name else {}
                    runs[category][name].append(run(engine, [prompt], max_tokens, {**spec, **shares}))
    summary, rows = {}, []
    for category, by_config in runs.items():
        plain = median([r["tok_s"] for r in by_config["no-spec"]])
        entry = {"no-spec tok/s": plain}
        row = [category, f"{plain:.1f}"]
        for name in drafters:
            rate = median([r["tok_s"] for r in by_config[name]])
            mats = [r["mat"] for r in by_config[name] if r["mat"]]
            entry[name] = {"tok_s": rate, "speedup": rate / plain, "mat": median(mats) if mats else None}
            row += [f"{rate / plain:.2f}x", "-" if not mats else f"{median(mats):.2f}"]
        summary[category] = entry
        rows.append(row)
    means = {name: {"speedup": statistics.mean(e[name]["speedup"] for e in summary.values()),
                    "mat": statistics.mean(e[name]["mat"] or 1.0 for e in summary.values())} for name in drafters}
    rows.append(["**mean**", f"{statistics.mean(e['no-spec tok/s'] for e in summary.values()):.1f}"]
                + [x for name in drafters for x in (f"**{means[name]['speedup']:.2f}x**",
                                                    f"**{means[name]['mat']:.2f}**")])
    same = all(a["token_ids"] == b["token_ids"] for by_config in runs.values() for name in drafters
               for a, b in zip(by_config["no-spec"], by_config[name], strict=True))
    agreement = {name: statistics.mean(_common_prefix(a["token_ids"][0], b["token_ids"][0])
                                       / max(1, len(a["token_ids"][0])) for by_config in runs.values()
                                       for a, b in zip(by_config["no-spec"], by_config[name], strict=True))
                 for name in drafters}
    header = ["category", "no-spec tok/s"] + [h for name in drafters for h in (f"{name} speed-up", "MAT")]
    result = {"machine": _machine(), "model": args.model, "max_tokens": max_tokens,
              "per_category": args.per_category, "repeats": args.repeats, "speculation": args.speculation,
              "dtype": str(engine.model.dtype).removeprefix("torch."),
              "tree_tokens": args.tree_tokens, "top_k": args.top_k, "beam": args.beam,
              "summary": summary, "mean_over_categories": means, "identical_to_no_spec": same,
              "agreement_with_no_spec": agreement,
              "engine_metrics": {"draft_s": engine.metrics.draft_s, "target_s": engine.metrics.target_s,
                                 "verify_s": engine.metrics.verify_s}}
    caption = (f"({part}) {args.model}, {result['dtype']}, {torch.get_num_threads()} threads, batch 1, "
               f"{max_tokens} new tokens, "
               f"greedy, Spec-Bench first turns ({args.per_category} per category x {args.repeats}), median per "
               f"category; the mean row averages the categories. Speculation {args.speculation}, cap "
               f"{args.tree_tokens}, model drafters top-k {args.top_k}, beam {args.beam}. Speculative tokens identical "
               f"to no-spec: {same} (bf16 rounding depends on a forward's shape); mean share of tokens before the "
               f"first difference: " + ", ".join(f"{k} {v:.0%}" for k, v in agreement.items())
               + ". Prefix caching off: every run prefills its prompt.")
    write_report(f"{args.out}-{part}{args.suffix}", result, caption, header, rows)


# -- (c) SmolLM2 under load ---------------------------------------------------------------------------


def part_c(args) -> None:
    levels = [int(c) for c in args.concurrency.split(",")]
    config = EngineConfig(draft=args.draft_c, speculation=args.speculation, kv_cache_memory="2GiB",
                          max_num_seqs=max(levels), max_tree_tokens=args.tree_tokens)
    configs = {"no-spec": {"enabled": False}, args.draft_c: None}
    # Two identical engines, one per configuration, stepped in turn (`side_by_side`): runs back
    # to back, seconds apart, measured this VM's drift (no-spec alone varied 2x between runs)
    # more than speculation.
    engines = {name: LLMEngine(resolve_model(args.model), args.dtype, config) for name in configs}
    # Round-robin over the categories. Each of the c closed-loop clients sends request after
    # request: steady state, c always in flight, until each engine generated as many tokens as
    # `--requests-per-client` requests per client make (at least `--requests-c` requests); with
    # `--drain`, exactly those requests, run to completion, so the last clients' drain counts.
    workload = {c: max(c * args.requests_per_client, args.requests_c) for c in levels}
    pool = load_prompts(engines["no-spec"], args.questions, max(workload.values()), max_prompt_tokens=384)
    for c in levels:  # warm-up at every level: the first 64-wide batch grows the allocator's pools
        side_by_side(engines, configs, pool[:c], 8, c)
    runs: dict[int, dict[str, list[dict]]] = {c: {name: [] for name in configs} for c in levels}
    for repeat in tqdm(range(args.repeats), desc="(c) repeats", unit="rep"):
        for c in levels:
            order = dict(list(configs.items())[:: 1 if repeat % 2 == 0 else -1])  # who steps first alternates
            tokens = None if args.drain else workload[c] * args.max_tokens_b
            for name, result in side_by_side(engines, order, pool[: workload[c]], args.max_tokens_b, c,
                                             tokens, args.length_spread).items():
                runs[c][name].append(result)
    dtype = str(engines["no-spec"].model.dtype).removeprefix("torch.")
    summary, rows = {}, []
    for c, by_config in runs.items():
        plain = median([r["tok_s"] for r in by_config["no-spec"]])
        spec = median([r["tok_s"] for r in by_config[args.draft_c]])
        # The ratio is the median of each repeat's own ratio (its two engines ran side by side).
        ratios = [s["tok_s"] / p["tok_s"] for p, s in zip(by_config["no-spec"], by_config[args.draft_c], strict=True)]
        drafted = sum(r["drafted"] for r in by_config[args.draft_c])
        mats = [r["mat"] for r in by_config[args.draft_c] if r["mat"]]
        summary[c] = {"no-spec tok/s": plain, "spec tok/s": spec, "ratio": median(ratios), "ratios": ratios,
                      "drafted": drafted, "mat": median(mats) if mats else None,
                      "tok_s": {name: [r["tok_s"] for r in rs] for name, rs in by_config.items()},
                      "steal": [r["steal"] for r in by_config["no-spec"]]}
        rows.append([str(c), f"{plain:.1f}", f"{spec:.1f}", f"{median(ratios):.2f}x",
                     f"{min(ratios):.2f}-{max(ratios):.2f}", str(drafted), "-" if not mats else f"{median(mats):.2f}"])
    result = {"machine": _machine(), "model": args.model, "draft": args.draft_c, "max_tokens": args.max_tokens_b,
              "length_spread": args.length_spread, "dtype": dtype,
              "requests": workload, "drain": args.drain, "repeats": args.repeats, "speculation": args.speculation,
              "summary": summary}
    load = ("send exactly these, run to completion (drain included)" if args.drain else
            "send request after request (steady state, c in flight) until each engine generated their tokens")
    lengths = (f"{args.max_tokens_b} new tokens per request" if not args.length_spread else
               f"{args.max_tokens_b} +- {args.length_spread:.0%} new tokens per request (uniform, the same per "
               f"request number for both engines)")
    caption = (f"(c) {args.model}, {dtype}, {lengths}; c clients in a closed loop "
               f"and max({args.requests_per_client}c, {args.requests_c}) Spec-Bench questions (round-robin over "
               f"categories): {load}; `{args.draft_c}` with {args.speculation} tree budgets (cap {args.tree_tokens}) "
               f"vs no speculation on two identical engines stepped in turn, each timed by its own steps; "
               f"{args.repeats} repeats; ratio: the median of the repeats' ratios.")
    write_report(args.out + "-c", result, caption, ["concurrent", "no-spec tok/s", "spec tok/s", "ratio",
                                                    "ratio range", "drafted tokens", "MAT"], rows)


def _machine() -> dict:
    return {"processor": processor_name(), "threads": torch.get_num_threads(), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="a,b,c")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH, help="Spec-Bench questions (jsonl)")
    parser.add_argument("--speculation", default="adaptive", choices=["adaptive", "fixed"])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-tokens-a", type=int, default=128)
    parser.add_argument("--chain-tokens", type=int, default=8)
    parser.add_argument("--tree-tokens", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, default=32768, help="(a) draft LM head over the first N ids; 0: all")
    parser.add_argument("--draft-quantization", default="int8", choices=["int8", "none"],
                        help="(a) specserve's draft projections (transformers' assistant stays bf16)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--early-exit", type=int, default=15)
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", help="(b, c, d) activations; 'auto': the engine's for this CPU")
    parser.add_argument("--max-tokens-b", type=int, default=64)
    parser.add_argument("--max-tokens-d", type=int, default=128)
    parser.add_argument("--drafters-d", default="early-exit:15,early-exit:trained,feature,ngram,feature+ngram",
                        help="(d) drafter specs compared with no speculation, comma-separated")
    parser.add_argument("--draft-c", default="ngram")
    parser.add_argument("--length-spread", type=float, default=0.5,
                        help="(c) request lengths vary uniformly by this share of --max-tokens-b (0: all equal)")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--requests-c", type=int, default=13, help="(c) requests per level at least (one per category)")
    parser.add_argument("--requests-per-client", type=int, default=3,
                        help="(c) the tokens of this many requests per client are generated per level")
    parser.add_argument("--drain", action="store_true",
                        help="(c) each client sends exactly that many requests, run to completion")
    parser.add_argument("--out", default=str(RESULTS / "speculative"))
    parser.add_argument("--suffix", default="", help="(b, d) appended to the result files' names")
    args = parser.parse_args()
    args.dtype = None if args.dtype == "auto" else args.dtype
    torch.manual_seed(0)
    parts = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}
    for part in args.parts.split(","):
        parts[part.strip()](args)


if __name__ == "__main__":
    main()
