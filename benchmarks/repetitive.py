"""A repetitive workload, where drafting from earlier requests' outputs pays: suffix decoding
against per-request n-gram lookup and no speculation, at batch 1, greedy.

The workload (made here from a fixed seed; nothing from Spec-Bench), requests in order:
- field extraction: invoices written in varied prose, each asked for the same JSON fields;
- code edits: conversations whose every turn asks to change the previous answer's code (the
  answer is in the chat history, as a client sends it).
Extraction requests and the turns of the conversations are interleaved, as a service sees them.

Each configuration runs on its own engine, request by request in turn, so the suffix drafter's
cross-request cache holds exactly the outputs of the requests before. Prefix caching is on, as a
server has it by default (a conversation's turn prefills only what its history does not share
with the turn before); `--no-prefix-caching` makes every request prefill its whole prompt, which
the three configurations then pay alike. Conversations carry the no-speculation engine's answers
forward; greedy speculation gives the same tokens (checked). A repeat starts every engine
afresh (an empty cache); the table gives medians over repeats of whole-workload tok/s.

    python benchmarks/repetitive.py [--model smollm2-135m-instruct] [--requests 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

import torch
from report import write_report
from tqdm import tqdm

from specserve.closed_loop import run_to_completion
from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.machine import processor_name
from specserve.pull import resolve_model
from specserve.sampling import SamplingParams
from specserve.sequence import SpecStats

RESULTS = Path(__file__).parent / "results"

VENDORS = ["Acme Tools", "Northwind Traders", "Blue Harbor Supply", "Greenfield Farms", "Orbit Electronics",
           "Summit Office Co.", "Redwood Hardware", "Lakeside Paper"]
CITIES = ["Springfield", "Riverton", "Fairview", "Madison", "Georgetown", "Salem", "Franklin", "Clinton"]
ITEMS = ["cordless drill", "office chair", "LED desk lamp", "printer paper (box)", "garden hose", "USB-C cable",
         "steel shelving unit", "coffee beans (1 kg)", "safety gloves", "wireless mouse"]
TEMPLATES = [
    "Invoice {number} from {vendor}, {city}, dated {date}: {quantity} x {item} at ${price:.2f} each, "
    "total ${total:.2f}.",
    "On {date} {vendor} ({city}) billed us for {quantity} units of {item}. Unit price ${price:.2f}; amount due "
    "${total:.2f}. Reference: {number}.",
    "{vendor} of {city} sent invoice {number} on {date}. It lists {item}, quantity {quantity}, ${price:.2f} per "
    "unit, ${total:.2f} in total.",
]
KEYS = "vendor, invoice_number, date, item, quantity, unit_price, total, city"
TASKS = [
    "Write a Python function `average(numbers)` that returns the mean of a list, or None for an empty list.",
    "Write a Python function `word_counts(text)` that returns a dict from each word to how often it occurs.",
    "Write a Python class `Stack` with push, pop and peek methods backed by a list.",
    "Write a Python function `is_palindrome(s)` that ignores case and spaces.",
    "Write a Python function `fizzbuzz(n)` that returns the FizzBuzz strings from 1 to n.",
]
EDITS = [
    "Add type hints and a docstring to that code. Reply with the whole code.",
    "Now rename the main function or class to have a clearer name. Reply with the whole code.",
    "Add input validation that raises ValueError on bad input. Reply with the whole code.",
    "Add a short example of its use under `if __name__ == \"__main__\":`. Reply with the whole code.",
]


def invoice(rng: random.Random) -> str:
    quantity, price = rng.randint(1, 40), rng.randint(199, 25000) / 100
    document = rng.choice(TEMPLATES).format(
        number=f"INV-{rng.randint(10000, 99999)}", vendor=rng.choice(VENDORS), city=rng.choice(CITIES),
        date=f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}", quantity=quantity, item=rng.choice(ITEMS),
        price=price, total=quantity * price)
    return f"Extract the fields of this invoice as JSON with the keys {KEYS}.\n\n{document}"


def workload(requests: int, seed: int = 0) -> list[tuple[str, int | None]]:
    """What each request is, in order: ("invoice text", None), or (edit or task, conversation)
    for a conversation's turn. Two of every three requests are extractions."""
    rng = random.Random(seed)
    turns = {c: 0 for c in range(len(TASKS))}
    order: list[tuple[str, int | None]] = []
    for k in range(requests):
        open_conversations = [c for c, t in turns.items() if t <= len(EDITS)]
        if k % 3 == 2 and open_conversations:
            c = open_conversations[k // 3 % len(open_conversations)]
            order.append((TASKS[c] if turns[c] == 0 else EDITS[turns[c] - 1], c))
            turns[c] += 1
        else:
            order.append((invoice(rng), None))
    return order


def run_once(model: Path, configs: dict[str, str | None], order: list[tuple[str, int | None]],
             max_tokens: int, max_tree_tokens: int, prefix_caching: bool) -> dict[str, dict]:
    """The workload through one fresh engine per configuration, request by request in turn."""
    engines = {name: LLMEngine(model, None, EngineConfig(draft=drafter or "none", kv_cache_memory="512MiB",
                                                          enable_prefix_caching=prefix_caching,
                                                          max_tree_tokens=max_tree_tokens))
               for name, drafter in configs.items()}
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    histories: dict[int, list[dict[str, str]]] = {}
    stats = {name: {"seconds": 0.0, "tokens": 0, "spec": SpecStats(), "outputs": []} for name in configs}
    for text, conversation in tqdm(order, desc="requests", unit="request", leave=False):
        messages = [*histories.get(conversation, []), {"role": "user", "content": text}]
        answers = {}
        for name, engine in engines.items():
            (final,), _, seconds = run_to_completion(engine, [engine.encode_chat(messages)], greedy)
            entry = stats[name]
            entry["seconds"] += seconds
            entry["tokens"] += len(final.outputs[0].token_ids)
            entry["spec"].add(final.metrics.spec)
            entry["outputs"].append(list(final.outputs[0].token_ids))
            answers[name] = final.outputs[0].text
        if conversation is not None:
            histories[conversation] = [*messages, {"role": "assistant", "content": next(iter(answers.values()))}]
    plain = next(iter(stats.values()))["outputs"]
    return {name: {"tok_s": s["tokens"] / s["seconds"], "tokens": s["tokens"], "seconds": s["seconds"],
                   "mat": s["spec"].mean_accepted_tokens, "drafted": s["spec"].drafted_tokens,
                   "accepted": s["spec"].accepted_tokens, "identical": s["outputs"] == plain}
            for name, s in stats.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tree-tokens", type=int, default=8, help="drafted nodes per step at most (the cap)")
    parser.add_argument("--drafters", default="ngram,suffix", help="compared with no speculation, comma-separated")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="the engines' prefix caching (on: the server's default)")
    parser.add_argument("--out", default=str(RESULTS / "repetitive"))
    args = parser.parse_args()

    model = resolve_model(args.model)
    configs: dict[str, str | None] = {"no-spec": None, **{d: d for d in args.drafters.split(",")}}
    order = workload(args.requests)
    run_once(model, configs, order[:3], 16, args.max_tree_tokens, args.prefix_caching)  # loads, calibrates once
    runs = [run_once(model, configs, order, args.max_tokens, args.max_tree_tokens, args.prefix_caching)
            for _ in tqdm(range(args.repeats), desc="repeats")]
    summary = {}
    for name in configs:
        rates = [r[name]["tok_s"] for r in runs]
        speedups = [r[name]["tok_s"] / r["no-spec"]["tok_s"] for r in runs]
        summary[name] = {"tok_s": statistics.median(rates), "speedup": statistics.median(speedups),
                         "speedup_range": [min(speedups), max(speedups)],
                         "mat": statistics.median([r[name]["mat"] or 1.0 for r in runs]),
                         "identical_to_no_spec": all(r[name]["identical"] for r in runs)}
    versus = statistics.median([r["suffix"]["tok_s"] / r["ngram"]["tok_s"] for r in runs]) \
        if {"suffix", "ngram"} <= set(configs) else None
    header = ["configuration", "tok/s", "vs no-spec", "range", "MAT", "same tokens"]
    rows = [[name, f"{s['tok_s']:.1f}", f"{s['speedup']:.2f}x",
             f"{s['speedup_range'][0]:.2f}-{s['speedup_range'][1]:.2f}", f"{s['mat']:.2f}",
             str(s["identical_to_no_spec"])] for name, s in summary.items()]
    cpu = processor_name()
    result = {"cpu": cpu, "threads": torch.get_num_threads(), "model": args.model, "requests": args.requests,
              "max_tokens": args.max_tokens, "max_tree_tokens": args.max_tree_tokens, "repeats": args.repeats,
              "prefix_caching": args.prefix_caching, "summary": summary,
              "suffix_vs_ngram": versus, "runs": runs}
    extraction = sum(conversation is None for _, conversation in order)
    caption = (f"Repetitive workload on {args.model} ({cpu}, {torch.get_num_threads()} threads): {args.requests} "
               f"requests in order ({extraction} invoice field extractions, {args.requests - extraction} code-edit "
               f"turns over {len(TASKS)} conversations), batch 1, greedy, at most {args.max_tokens} new tokens, EOS "
               f"respected, prefix caching {'on' if args.prefix_caching else 'off'}, adaptive speculation capped at "
               f"{args.max_tree_tokens} drafted nodes; "
               f"each configuration on a fresh engine per repeat; medians of "
               f"{args.repeats} repeats of whole-workload tok/s.")
    if versus is not None:
        caption += f" suffix / ngram: {versus:.2f}x."
    write_report(args.out, result, caption, header, rows)


if __name__ == "__main__":
    main()
