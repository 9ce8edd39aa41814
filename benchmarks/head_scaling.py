"""How a feature head's agreement with its target grows with training data, and what that implies
for the mean accepted tokens per target forward (MAT) a head trained on this CPU can reach.

The target's answers and hidden states come from `specserve train-drafter`'s cache (generated
if missing). Feature heads train on the first fraction of the training answers (same settings,
same epochs, so data and training time grow together) and are scored on two held-out sets:

- validation: held-out GPTeacher answers (the training domain);
- spec-bench: the target's greedy answers to the first Spec-Bench questions of each category
  (evaluation only: never trained on).

Agreement at depth d: the share of answer tokens the target would choose that are among the
head's top-k guesses when the head reads the features it predicted itself d - 1 times over (as
drafting does). A top-k tree accepts depth d only if the target's token is among the k children
there, so top-k agreement bounds the per-depth acceptance from above, and

    MAT bound = 1 + a1 + a1 a2 + a1 a2 a3 + a1 a2 a3^2 + ...  (depth 3's rate carried to the cap)

bounds the MAT of a top-k tree of that depth (chains of k = 1 pay less, trees as wide as k pay
more per forward). The fit of Spec-Bench agreement against log2(training tokens) estimates the data
a head would need for a chosen MAT bound.

    python benchmarks/head_scaling.py [--fractions 0.125,0.25,0.5,1] [--epochs 1]
    python benchmarks/head_scaling.py --self-instruct 3000 --follow-ups 1000 --fractions none --heads DIR

(the second scores a head trained elsewhere, e.g. by `train-drafter` on that data, beside the
shipped one, on that data's held-out answers and on Spec-Bench, training none).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch
from engine import SPEC_BENCH  # benchmarks/engine.py
from engine import spec_bench_questions as questions
from report import write_report
from safetensors.torch import load_file

from drafters.heads import HeadConfig, find_head
from specserve.machine import processor_name
from specserve.training.data import GenerationSettings, extract, generate
from specserve.training.heads import TrainableHead
from specserve.training.train import (
    TrainSettings,
    _answer_rows,
    draft_vocabulary,
    evaluate,
    fit,
    prepare_data,
)

RESULTS = Path(__file__).parent / "results"


def mat_bound(agreement: list[float], cap: int) -> float:
    """1 + a1 + a1 a2 + ... over `cap` depths, the last measured rate carried on."""
    total, run = 1.0, 1.0
    for depth in range(cap):
        run *= agreement[min(depth, len(agreement) - 1)]
        total += run
    return total


def spec_bench_features(prepared, per_category: int, max_tokens: int, path: Path):
    """The target's greedy answers to the first Spec-Bench questions per category, and its
    hidden states over them (for scoring only)."""
    texts = [q for qs in questions(path).values() for q in qs[:per_category]]
    settings = GenerationSettings(samples=len(texts), max_new_tokens=max_tokens, max_prompt_tokens=4096)
    with tempfile.TemporaryDirectory() as tmp:
        examples = generate(prepared.engine, texts, settings, Path(tmp) / "answers.jsonl")
    final = prepared.model.config.num_layers
    return extract(prepared.model, examples, [final])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--samples", type=int, default=3000,
                        help="GPTeacher answers generated (the shipped head's data)")
    parser.add_argument("--self-instruct", type=int, default=0,
                        help="answers to prompts the target writes itself, added (`train-drafter --self-instruct`)")
    parser.add_argument("--follow-ups", type=int, default=0,
                        help="answers to follow-up turns it writes after those (`train-drafter --follow-ups`)")
    parser.add_argument("--fractions", default="0.125,0.25,0.5,1",
                        help="shares of the training answers a head is trained on; 'none': no such heads")
    parser.add_argument("--heads", default="", help="head directories scored beside the shipped one, comma-separated "
                                                     "(e.g. one `specserve train-drafter` made on other data)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--cap", type=int, default=16, help="tree depth the MAT bound runs to")
    parser.add_argument("--mat", type=float, default=3.0, help="the MAT bound to estimate the data for")
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH)
    parser.add_argument("--out", default=str(RESULTS / "head-scaling"))
    args = parser.parse_args()
    torch.manual_seed(0)
    settings = TrainSettings(kind="feature", epochs=args.epochs)
    prepared = prepare_data(args.model, settings, GenerationSettings(samples=args.samples,
                                                                     self_instruct=args.self_instruct,
                                                                     follow_ups=args.follow_ups))
    features, final = prepared.features, prepared.model.config.num_layers
    train_ids, val_ids = features.split(settings.validation, settings.seed)
    bench = spec_bench_features(prepared, args.per_category, args.max_tokens, args.questions)
    bench_ids = list(range(len(bench)))

    def score(head: TrainableHead, run: dict) -> dict:
        for name, feats, ids in (("validation", features, val_ids), ("spec-bench", bench, bench_ids)):
            for k in (1, args.top_k):
                _, by_depth = evaluate(head, feats, ids, settings, final, final, top_k=k)
                run[f"{name} top-{k}"] = by_depth
        run["mat_bound"] = mat_bound(run[f"spec-bench top-{args.top_k}"], args.cap)
        run["validation_mat_bound"] = mat_bound(run[f"validation top-{args.top_k}"], args.cap)
        print(run)
        return run

    runs = []
    fractions = [] if args.fractions == "none" else [float(f) for f in args.fractions.split(",")]
    for fraction in fractions:
        subset = train_ids[: max(1, round(fraction * len(train_ids)))]
        torch.manual_seed(settings.seed)
        vocab_ids, _ = draft_vocabulary(features, subset, settings.draft_vocab, prepared.model.config)
        head = TrainableHead(prepared.model, "feature", prepared.layer, vocab_ids)
        started = time.perf_counter()
        fit(head, features, subset, val_ids, settings, final, final)
        seconds = time.perf_counter() - started
        runs.append(score(head, {"fraction": fraction, "answers": len(subset), "epochs": args.epochs,
                                 "train_tokens": sum(_answer_rows(features, e) for e in subset),
                                 "train_seconds": round(seconds, 1)}))
    # The shipped head, and any given, scored alike (on this data's validation answers).
    def trained(head_dir: Path) -> dict:
        training = HeadConfig.load(head_dir).training
        weights = load_file(str(head_dir / "head.safetensors"))
        head = TrainableHead.from_tensors(prepared.model, "feature", final, weights)
        held_out = max(1, round(training["settings"]["validation"] * training["answers"]))  # as Features.split
        return score(head, {"head": str(head_dir), "answers": training["answers"] - held_out,
                            "epochs": training["settings"]["epochs"], "train_tokens": training["train_tokens"],
                            "train_seconds": sum(e["seconds"] for e in training["epochs"])})

    shipped_run = trained(find_head("feature", None, prepared.model_dir))
    given = [trained(Path(d).expanduser()) for d in args.heads.split(",") if d]

    # Spec-Bench depth-1 top-k agreement against log2(tokens): a least-squares line through the runs.
    key = f"spec-bench top-{args.top_k}"
    xs = [math.log2(r["train_tokens"]) for r in runs]
    slope = intercept = needed = None
    if len(runs) >= 2:
        mean_x = sum(xs) / len(xs)
        ratios = [r[key][-1] / r[key][0] for r in runs]  # deeper depths relative to depth 1
        ys = [r[key][0] for r in runs]
        mean_y = sum(ys) / len(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mean_x) ** 2 for x in xs)
        intercept = mean_y - slope * mean_x
        # The depth-1 agreement whose MAT bound reaches args.mat, deeper depths keeping the last
        # run's ratio to depth 1.
        last = runs[-1][key]
        target_a1 = next((a / 1000 for a in range(1, 1000)
                          if mat_bound([min(1.0, a / 1000 * r / last[0]) for r in last], args.cap) >= args.mat), None)
        if slope > 0 and target_a1 is not None:
            needed = 2 ** ((target_a1 - intercept) / slope)
        print(f"fit: depth-1 {key} = {intercept:.3f} + {slope:.3f} log2(tokens); ratios {ratios}")

    result = {
        "machine": processor_name(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "model": args.model, "samples": args.samples, "settings": vars(args) | {
            "questions": str(args.questions)},
        "train_settings": settings.__dict__, "prompts": prepared.prompts, "spec_bench_answers": len(bench),
        "runs": runs,
        "shipped": shipped_run,
        "heads": given,
        "fit": {"slope_per_doubling": slope, "intercept": intercept, "tokens_for_mat": needed,
                "mat": args.mat},
    }
    header = ["head", "answers", "train tokens", "train s", "val top-1 by depth", f"val top-{args.top_k}",
              "Spec-Bench top-1", f"Spec-Bench top-{args.top_k}", "MAT bound val", "MAT bound Spec-Bench"]

    def pct(values: list[float]) -> str:
        return "/".join(f"{v:.0%}" for v in values)

    def label(r: dict) -> str:
        if r is shipped_run:
            return f"{r['epochs']} epoch(s) (shipped)"
        return f"{r['epochs']} epoch(s)" + (f" ({Path(r['head']).name})" if "head" in r else "")

    rows = [[label(r), str(r["answers"]),
             f"{r['train_tokens']:,}", f"{r['train_seconds']:.0f}", pct(r["validation top-1"]),
             pct(r[f"validation top-{args.top_k}"]), pct(r["spec-bench top-1"]), pct(r[key]),
             f"{r['validation_mat_bound']:.2f}", f"{r['mat_bound']:.2f}"] for r in [*runs, shipped_run, *given]]
    extrapolation = "" if needed is None else (
        f" Fit: Spec-Bench depth-1 top-{args.top_k} agreement gains {slope:.1%} per doubling of the training "
        f"tokens; a MAT bound of {args.mat} would need about {needed:,.0f} tokens, "
        f"{needed / runs[-1]['train_tokens']:.0f}x the largest run's.")
    data = f"{args.samples} self-distilled GPTeacher answers" + (
        f" and {args.self_instruct} to prompts it wrote itself (self-instruct)" if args.self_instruct else "") + (
        f" and {args.follow_ups} to follow-up turns it wrote after its own answers" if args.follow_ups else "")
    also = "".join(f", and {Path(r['head']).name} (`--heads`)" for r in given)
    shares = (f"Feature heads for {args.model} on growing shares of {data} ({args.epochs} epoch(s), training-time "
              f"test {settings.unroll} passes, bf16 autocast, {torch.get_num_threads()} threads), and the shipped "
              f"head" if runs else f"For {args.model}, on held-out answers of {data}: the shipped feature head")
    caption = (f"{shares} ({shipped_run['answers']} training answers, {shipped_run['epochs']} epochs){also}. "
               f"Agreement with "
               f"the target's next token by drafting depth "
               f"(1/2/3), teacher-forced, on held-out training answers (val) and on the target's answers to "
               f"{len(bench)} Spec-Bench first turns ({args.per_category} per category, evaluation only). MAT bound: "
               f"1 + a1 + a1 a2 + ... to depth {args.cap} from the top-{args.top_k} rates: no top-"
               f"{args.top_k} tree of that depth should accept more on average (teacher-forced rates).{extrapolation}")
    write_report(args.out, result, caption, header, rows)
    if runs:
        plot(runs, key, slope, intercept, needed, Path(f"{args.out}.png"))


def plot(runs: list[dict], key: str, slope, intercept, needed, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [r["train_tokens"] for r in runs]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, style in (("validation top-1", "o-"), ("spec-bench top-1", "s-"), (key.replace("spec-bench",
                                                                                              "validation"), "o--"),
                        (key, "s--")):
        ax.plot(tokens, [r[name][0] for r in runs], style, label=name)
    if slope is not None and needed is not None:
        xs = [tokens[0], needed]
        ax.plot(xs, [intercept + slope * math.log2(x) for x in xs], ":", color="grey", label=f"fit of {key}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training answer tokens")
    ax.set_ylabel("depth-1 agreement with the target")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
