"""Forward time of our model vs transformers on the same weights and dtype.

For N new tokens (a chain: a prefill chunk or a chain-shaped verification) after a
128-token prefix, both models compute logits for every new token. Both run in one
process, interleaved per size, after warm-up; we report the median of the repeats and
the ratio ours / transformers (lower is better; the target is <= 1.2 in bf16).

    python benchmarks/forward.py [--model smollm2-135m-instruct] [--dtype bfloat16] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from report import write_report
from tqdm import tqdm

from specserve.kv_cache import KVCache
from specserve.machine import processor_name
from specserve.model_runner import ModelRunner, TreeRequest
from specserve.models.loader import load_model, load_transformers, parse_dtype
from specserve.pull import resolve_model
from specserve.tree import TokenTree

RESULTS = Path(__file__).parent / "results"


def ours_step(model, prefix: list[int], new: list[int]) -> Callable[[], float]:
    """Prefill the prefix once; each call times one forward of the new tokens."""
    block_size = 16
    blocks = -(-(len(prefix) + len(new)) // block_size)
    runner = ModelRunner(model, KVCache.for_model(model.config, blocks, block_size, model.dtype))
    table = list(range(blocks))
    runner.forward([TreeRequest(TokenTree.chain(prefix), 0, table, logits="last")])
    step = [TreeRequest(TokenTree.chain(new), len(prefix), table, logits="all")]

    def run() -> float:
        start = time.perf_counter()
        runner.forward(step)  # rewrites the same slots each time: the cache stays at the prefix
        return time.perf_counter() - start

    return run


def transformers_step(model, prefix: list[int], new: list[int]) -> Callable[[], float]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.tensor([prefix]), past_key_values=cache, use_cache=True)
    ids = torch.tensor([new])

    @torch.inference_mode()
    def run() -> float:
        start = time.perf_counter()
        model(ids, past_key_values=cache, use_cache=True)
        elapsed = time.perf_counter() - start
        cache.crop(-len(new))  # back to the prefix (outside the timed region)
        return elapsed

    return run


def interleaved(steps: dict[str, Callable[[], float]], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Alternate the contenders call by call, so machine noise hits both alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(warmup + repeats):
        for name, step in steps.items():
            elapsed = step()
            if i >= warmup:
                times[name].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--sizes", default="1,8,32,64")
    parser.add_argument("--prefix", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "forward"))
    args = parser.parse_args()


    path = resolve_model(args.model)
    dtype = parse_dtype(args.dtype)
    ours = load_model(path, dtype)
    theirs = load_transformers(path, dtype)
    gen = torch.Generator().manual_seed(0)
    vocab = ours.config.vocab_size
    prefix = torch.randint(0, vocab, (args.prefix,), generator=gen).tolist()

    rows = []
    for n in tqdm([int(s) for s in args.sizes.split(",")], desc="sizes"):
        new = torch.randint(0, vocab, (n,), generator=gen).tolist()
        times = interleaved(
            {"ours": ours_step(ours, prefix, new), "theirs": transformers_step(theirs, prefix, new)},
            args.repeats, args.warmup,
        )
        ours_t, theirs_t = times["ours"], times["theirs"]
        o, t = statistics.median(ours_t), statistics.median(theirs_t)
        rows.append({"new_tokens": n, "ours_ms": o * 1e3, "transformers_ms": t * 1e3, "ratio": o / t,
                     "ours_all_ms": [x * 1e3 for x in ours_t], "transformers_all_ms": [x * 1e3 for x in theirs_t]})

    result = {
        "benchmark": "forward", "model": args.model, "dtype": args.dtype, "prefix": args.prefix,
        "repeats": args.repeats, "warmup": args.warmup, "threads": torch.get_num_threads(),
        "machine": processor_name(), "torch": torch.__version__,
        "rows": rows,
    }
    write_report(
        args.out, result,
        f"Forward time after a {args.prefix}-token prefix, {args.model}, {args.dtype}, {torch.get_num_threads()} "
        f"threads, median of {args.repeats} interleaved runs (after {args.warmup} warm-up)",
        ["new tokens", "specserve (ms)", "transformers (ms)", "specserve / transformers"],
        [[str(r["new_tokens"]), f"{r['ours_ms']:.1f}", f"{r['transformers_ms']:.1f}", f"{r['ratio']:.2f}x"]
         for r in rows],
    )

if __name__ == "__main__":
    main()
