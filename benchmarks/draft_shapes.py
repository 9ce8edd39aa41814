"""How a draft model's settings pay at batch 1: the engine's defaults against the alternatives,
each configuration a separate engine in one process, taking turns request by request.

Configurations: plain decoding; adaptive speculation with 4-wide trees and the whole vocabulary
(the GPU defaults); adaptive chains with the whole vocabulary; adaptive chains over the draft's
first 32k tokens (the CPU defaults), and with the draft requantized to int4; fixed chains of 2
and 3 over those tokens, with the GGUF's draft and with int4. Greedy, Spec-Bench
coding prompts in the target's chat template, 128 tokens each (EOS ignored). Turns request by
request spread a busy VM's drift over all of them; each request's speed-up is over the plain
engine's on the same prompt and turn, and the table gives their median.

    python benchmarks/draft_shapes.py [--target qwen2.5-coder-1.5b-instruct] [--prompts 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from peers import SUITES, prompt_texts
from report import write_report
from tqdm import tqdm

from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.machine import processor_name
from specserve.pull import resolve_model
from specserve.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results"
CHAIN = {"draft_top_k": 1, "draft_beam": 1}
WHOLE_VOCAB = 1 << 30  # larger than any vocabulary: score every token


def configurations(draft: str) -> dict[str, dict]:
    return {
        "plain": {"speculation": "off"},
        "adaptive, 4-wide trees, whole vocabulary": {"draft": draft, "draft_top_k": 4, "draft_beam": 4,
                                                     "draft_vocab": WHOLE_VOCAB},
        "adaptive chains, whole vocabulary": {"draft": draft, **CHAIN, "draft_vocab": WHOLE_VOCAB},
        "adaptive chains, 32k tokens (CPU defaults)": {"draft": draft},
        "adaptive chains, 32k tokens, int4 draft": {"draft": draft, "draft_quantization": "int4"},
        "fixed chains of 2, 32k tokens": {"draft": draft, "speculation": "fixed", "max_tree_tokens": 2, **CHAIN},
        "fixed chains of 3, 32k tokens": {"draft": draft, "speculation": "fixed", "max_tree_tokens": 3, **CHAIN},
        "fixed chains of 2, 32k tokens, int4 draft": {"draft": draft, "speculation": "fixed", "max_tree_tokens": 2,
                                                      **CHAIN, "draft_quantization": "int4"},
        "fixed chains of 3, 32k tokens, int4 draft": {"draft": draft, "speculation": "fixed", "max_tree_tokens": 3,
                                                      **CHAIN, "draft_quantization": "int4"},
    }


def generate(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams):
    """One request alone: (seconds, its finished output)."""
    engine.add_request(request_id, prompt, params)
    finished = []
    start = time.perf_counter()
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    return time.perf_counter() - start, finished[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=SUITES["qwen"].target)
    parser.add_argument("--draft", default=SUITES["qwen"].draft)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(RESULTS / "draft-shapes"))
    args = parser.parse_args()

    target = resolve_model(args.target)
    texts = prompt_texts(target, SUITES["qwen"])[: args.prompts]
    settings = configurations(args.draft)
    engines = {name: LLMEngine(target, None, EngineConfig(kv_cache_memory="256MiB", **options))
               for name, options in tqdm(settings.items(), desc="engines")}
    warm = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for engine in engines.values():  # first forwards, and a first look at the drafter's cost
        generate(engine, "warm-up", engine.encode(texts[-1]), warm)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    records = {name: [] for name in engines}
    turns = [(r, i) for r in range(args.rounds) for i in range(len(texts))]
    for r, i in tqdm(turns, desc="turns"):
        for name, engine in engines.items():
            seconds, out = generate(engine, f"{r}-{i}", engine.encode(texts[i]), params)
            spec = out.metrics.spec
            records[name].append({"seconds": seconds, "tokens": len(out.outputs[0].token_ids),
                                  "verify_steps": spec.verify_steps, "drafted": spec.drafted_tokens,
                                  "accepted": spec.accepted_tokens, "target_forwards": spec.target_forwards})

    plain = [rec["tokens"] / rec["seconds"] for rec in records["plain"]]
    rows = []
    for name, recs in records.items():
        speeds = [rec["tokens"] / rec["seconds"] for rec in recs]
        tokens = sum(rec["tokens"] for rec in recs)
        drafted, accepted = sum(rec["drafted"] for rec in recs), sum(rec["accepted"] for rec in recs)
        rows.append({"configuration": name, "options": settings[name],
                     "tok_s": tokens / sum(rec["seconds"] for rec in recs),
                     "speedup_median": statistics.median(s / p for s, p in zip(speeds, plain, strict=True)),
                     "tokens_per_forward": tokens / max(1, sum(rec["target_forwards"] for rec in recs)),
                     "drafted": drafted, "accepted_share": accepted / drafted if drafted else None,
                     "requests": recs})
    result = {"benchmark": "draft_shapes", "target": args.target, "draft": args.draft, "machine": processor_name(),
              "threads": torch.get_num_threads(), "max_tokens": args.max_tokens, "prompts": len(texts),
              "rounds": args.rounds, "rows": rows}
    write_report(
        args.out, result,
        f"Draft settings at batch 1: {args.target} with {args.draft}, {processor_name()}, "
        f"{torch.get_num_threads()} threads, {len(texts)} Spec-Bench coding prompts x {args.rounds} rounds, greedy, "
        f"{args.max_tokens} tokens; engines in one process taking turns request by request. Speed-up: median over "
        f"requests of tok/s over the plain engine's on the same prompt and turn",
        ["configuration", "tok/s", "speed-up", "tokens per target forward", "drafted", "accepted"],
        [[r["configuration"], f"{r['tok_s']:.1f}", f"{r['speedup_median']:.2f}x", f"{r['tokens_per_forward']:.2f}",
          str(r["drafted"]), f"{r['accepted_share']:.0%}" if r["accepted_share"] is not None else "-"] for r in rows],
    )


if __name__ == "__main__":
    main()
