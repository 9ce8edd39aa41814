"""How far greedy replies agree across ways of running the same target: alone or batched, with
speculation or without, in fp32 and bf16.

In fp32 every reply equals the plain one (the tests). In bf16 a request's logits could depend on
what else shares its forward: CPU SDPA rounded a query differently with the rows beside it, so a
verification tree's nodes, or prompts prefilled together, changed a row's bits. bf16 attention now
runs through the C++ kernel (each row alone, fp32 arithmetic), so what is left is the bf16 matmuls,
which on some CPUs (AMD EPYC with AVX512-BF16) round a row by the step's size.

Reference: each prompt decoded alone without speculation (prefix caching off throughout: a
cached prefix makes the rest of a prompt a different forward). Compared: the same all at once
(plain, batched), and n-gram speculation with chains and with trees.

    python benchmarks/greedy_agreement.py [--model smollm2-135m-instruct] [--prompts 13] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine import SPEC_BENCH, load_prompts  # noqa: I001  (benchmarks/engine.py)
from report import write_report
from tqdm import tqdm

from specserve.ablation.report import output_agreement
from specserve.closed_loop import run_to_completion
from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.machine import processor_name
from specserve.pull import resolve_model
from specserve.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results"
RUNS = {  # name: (n-gram tree shape or None for no speculation, requests in flight)
    "plain, batched": (None, None),
    "chain, alone": ("chain", 1),
    "tree, alone": ("tree", 1),
    "tree, batched": ("tree", None),
}


def replies(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, shape: str | None,
            concurrency: int | None) -> list[list[int]]:
    speculation = {"drafter": "ngram", "tree": shape} if shape else {"enabled": False}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, speculation=speculation)
    outputs, _, _ = run_to_completion(engine, prompts, params, concurrency)
    return [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=13)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(RESULTS / "greedy_agreement"))
    args = parser.parse_args()

    path = resolve_model(args.model)
    measured: dict[str, dict[str, dict]] = {}
    with tqdm(total=len(args.dtypes) * (len(RUNS) + 1), desc="greedy agreement", unit="run") as bar:
        for dtype in args.dtypes:
            engine = LLMEngine(path, dtype, EngineConfig(draft="ngram", speculation="fixed",
                                                         enable_prefix_caching=False, kv_cache_memory="1GiB"))
            prompts = load_prompts(engine, SPEC_BENCH, args.prompts, max_prompt_tokens=256)
            reference = replies(engine, prompts, args.max_tokens, None, 1)
            bar.update()
            rows = [{"config": "no-spec", "prompt": i, "repeat": 0, "output": r} for i, r in enumerate(reference)]
            for name, (shape, concurrency) in RUNS.items():
                outputs = replies(engine, prompts, args.max_tokens, shape, concurrency)
                rows += [{"config": name, "prompt": i, "repeat": 0, "output": r} for i, r in enumerate(outputs)]
                bar.update()
            measured[dtype] = output_agreement(rows)

    header = ["dtype", *[f"{name}: identical" for name in RUNS], *[f"{name}: agreeing share" for name in RUNS]]
    table = [[dtype, *[f"{by_run[n]['identical']}/{by_run[n]['of']}" for n in RUNS],
              *[f"{by_run[n]['prefix_share']:.0%}" for n in RUNS]] for dtype, by_run in measured.items()]
    caption = (f"Greedy replies of {args.model} against each prompt decoded alone without speculation "
               f"({args.prompts} Spec-Bench prompts, {args.max_tokens} tokens, {processor_name()}): how many "
               "are identical, and the mean share of a reply before the first difference. Batched: all "
               "prompts in flight at once (their prefills batched). Chain / tree: n-gram lookup, fixed budgets, "
               "trees grown level by level.")
    write_report(args.out, {"model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens,
                            "machine": processor_name(), "agreement": measured}, caption, header, table)


if __name__ == "__main__":
    main()
