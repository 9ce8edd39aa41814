"""How far greedy replies over a quantized KV cache agree with replies over the model's own-dtype
cache, per Spec-Bench category: the share of each reply before its first differing token.

Both engines run the same prompts, all in flight at once, without speculation (over an int8 cache
speculation gives plain decoding's tokens over that cache: the tests), prefix caching off. By
default the target runs as `serve` runs it (on a CPU a GGUF's own blocks); `--quantization none`
compares over plain weights, where a small perturbation of K/V does not also flip the int8
rounding of activations downstream.

    python benchmarks/kv_cache_agreement.py [--model smollm2-135m-instruct] [--per-category 4] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from report import write_report
from tqdm import tqdm

from specserve.ablation.config import SPEC_BENCH, spec_bench_by_category
from specserve.closed_loop import run_to_completion
from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.machine import processor_name
from specserve.pull import resolve_model
from specserve.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results"


def agreeing_share(reference: list[int], other: list[int]) -> float:
    """The share of `reference` before the first token where `other` differs."""
    same = next((i for i, (a, b) in enumerate(zip(reference, other, strict=False)) if a != b),
                min(len(reference), len(other)))
    return same / max(len(reference), 1)


def replies(model: Path, kv_cache_dtype: str, quantization: str, prompts: list[str],
            max_tokens: int) -> list[list[int]]:
    engine = LLMEngine(model, None, EngineConfig(kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                                                 speculation="off", enable_prefix_caching=False,
                                                 kv_cache_memory="1GiB"))
    ids = [engine.encode(p, chat=True) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs, _, _ = run_to_completion(engine, ids, greedy)
    return [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-dtype", default="int8", help="the quantized cache compared with auto")
    parser.add_argument("--quantization", default="auto", help="the target's weights, as serve takes them")
    parser.add_argument("--out", default=str(RESULTS / "kv-cache-agreement"))
    args = parser.parse_args()

    model = resolve_model(args.model)
    chosen = [(category, turn) for category, turns in spec_bench_by_category(SPEC_BENCH).items()
              for turn in turns[: args.per_category]]
    prompts = [turn for _, turn in chosen]
    runs = {}
    for kv in tqdm(["auto", args.kv_cache_dtype], desc="KV cache dtypes", unit="run"):
        runs[kv] = replies(model, kv, args.quantization, prompts, args.max_tokens)
    shares: dict[str, list[float]] = {}
    for (category, _), reference, other in zip(chosen, runs["auto"], runs[args.kv_cache_dtype], strict=True):
        shares.setdefault(category, []).append(agreeing_share(reference, other))
    identical = sum(a == b for a, b in zip(runs["auto"], runs[args.kv_cache_dtype], strict=True))
    rows = [[category, f"{statistics.mean(s):.0%}", f"{min(s):.0%}"] for category, s in shares.items()]
    mean = statistics.mean(statistics.mean(s) for s in shares.values())
    rows.append(["**mean**", f"**{mean:.0%}**", f"{min(min(s) for s in shares.values()):.0%}"])
    weights = "plain weights" if args.quantization == "none" else f"weights as served ({args.quantization})"
    caption = (f"Greedy replies of {args.model} ({weights}) over an {args.kv_cache_dtype} KV cache "
               f"against the same over its own-dtype cache: the share of a reply before its first differing token, "
               f"mean and lowest per Spec-Bench category ({args.per_category} first turns each, {args.max_tokens} "
               f"tokens, no speculation, {processor_name()}); {identical} of {len(prompts)} replies identical.")
    write_report(args.out, {"model": args.model, "machine": processor_name(), "quantization": args.quantization,
                            "kv_cache_dtype": args.kv_cache_dtype, "per_category": args.per_category,
                            "max_tokens": args.max_tokens, "mean_share": mean, "identical": identical,
                            "shares": shares, "replies": runs},
                 caption, ["category", "agreeing share (mean)", "lowest"], rows)


if __name__ == "__main__":
    main()
