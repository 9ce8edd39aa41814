"""An ablation's report: `report.md` (tables, the best configuration per category in bold) and
PNG plots, all computed from `results.json` alone.

Per configuration and category (concurrency 1): tok/s = the category's tokens over its
seconds, per repeat; speed-up = that over the baseline's in the same repeat; the median over
repeats. MAT = (accepted + verifying forwards) / verifying forwards; acceptance at depth d =
the share of verifying forwards that accepted at least d drafted tokens.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

BASELINE_NAME = "no-spec"


def summarize(results: dict) -> dict:
    """The report's numbers from the raw measurements."""
    single = [m for m in results["measurements"] if m["concurrency"] == 1]
    configs = list(dict.fromkeys(m["config"] for m in results["measurements"]))
    categories = list(dict.fromkeys(m["category"] for m in single))
    sums = _totals(single, lambda m: (m["config"], m["category"], m["repeat"]))
    table: dict[str, dict[str, dict]] = {}
    for config in configs:
        rows = {}
        for category in [*categories, "all"]:
            chosen = [m for m in single if m["config"] == config and category in ("all", m["category"])]
            if not chosen:
                continue
            rates, ratios = [], []
            for repeat in sorted({m["repeat"] for m in chosen}):
                mine = _rate(sums, config, category, repeat, categories)
                base = _rate(sums, BASELINE_NAME, category, repeat, categories)
                if mine is not None:
                    rates.append(mine)
                    if base:
                        ratios.append(mine / base)
            rows[category] = {"tok_s": statistics.median(rates), "speedup": statistics.median(ratios) if ratios
                              else None, **_spec(chosen)}
        if rows:
            table[config] = rows
    # Aggregate throughput per concurrency: per repeat, all tokens over all seconds (at c = 1 the
    # requests ran one at a time, so that is their sum); speed-up per repeat against the baseline's.
    rates: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    totals = _totals(results["measurements"], lambda m: (m["config"], m["concurrency"], m["repeat"]))
    for (config, c, repeat), (tokens, seconds) in totals.items():
        if seconds > 0:
            rates[config, c][repeat] = tokens / seconds
    throughput: dict[str, dict[int, dict]] = defaultdict(dict)
    for (config, c), by_repeat in rates.items():
        base = rates.get((BASELINE_NAME, c), {})
        ratios = [r / base[k] for k, r in by_repeat.items() if base.get(k)]
        runs = [m for m in results["measurements"] if m["config"] == config and m["concurrency"] == c]
        throughput[config][c] = {"tok_s": statistics.median(by_repeat.values()),
                                 "speedup": statistics.median(ratios) if ratios else None, **_spec(runs)}
    greedy = results["config"]["generation"].get("temperature", 1.0) == 0
    return {"categories": categories, "configs": configs, "per_category": table, "throughput": dict(throughput),
            "agreement": output_agreement(single) if greedy else {}}


def output_agreement(single: list[dict]) -> dict[str, dict]:
    """Per configuration, how its greedy outputs compare with the baseline's on the same prompt
    and repeat: how many are identical, and the mean share of a reply before the first
    difference. In fp32 every one is identical (the engine's tests); in bf16 too where the CPU's
    bf16 matmuls compute a row alike in any step (not on AMD EPYC with AVX512-BF16)."""
    base = {(m["prompt"], m["repeat"]): m["output"] for m in single if m["config"] == BASELINE_NAME}
    pairs: dict[str, list[tuple[list[int], list[int]]]] = defaultdict(list)
    for m in single:
        if m["config"] != BASELINE_NAME and m["output"] and (m["prompt"], m["repeat"]) in base:
            pairs[m["config"]].append((base[m["prompt"], m["repeat"]], m["output"]))
    agreement = {}
    for config, outputs in pairs.items():
        shares = [_common_prefix(a, b) / max(len(a), 1) for a, b in outputs]
        agreement[config] = {"identical": sum(a == b for a, b in outputs), "of": len(outputs),
                             "prefix_share": statistics.mean(shares)}
    return agreement


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _totals(measurements: list[dict], key: Callable[[dict], tuple]) -> dict[tuple, list[float]]:
    """key(measurement) -> [tokens, seconds] summed."""
    totals: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0])
    for m in measurements:
        cell = totals[key(m)]
        cell[0] += m["tokens"]
        cell[1] += m["seconds"]
    return totals


def _rate(sums: dict, config: str, category: str, repeat: int, categories: list[str]) -> float | None:
    chosen = categories if category == "all" else [category]
    tokens = sum(sums[config, c, repeat][0] for c in chosen if (config, c, repeat) in sums)
    seconds = sum(sums[config, c, repeat][1] for c in chosen if (config, c, repeat) in sums)
    return tokens / seconds if seconds > 0 else None


def _spec(measurements: list[dict]) -> dict:
    steps = sum(m["verify_steps"] for m in measurements)
    accepted = sum(m["accepted_tokens"] for m in measurements)
    depth = max((len(m["accepted_at_depth"]) for m in measurements), default=0)
    at_depth = [sum(m["accepted_at_depth"][d] for m in measurements if d < len(m["accepted_at_depth"]))
                for d in range(depth)]
    seconds = sum(m["seconds"] for m in measurements)
    return {"mat": (accepted + steps) / steps if steps else None,
            "acceptance_by_depth": [a / steps for a in at_depth] if steps else [],
            "drafted_per_step": sum(m["drafted_tokens"] for m in measurements) / steps if steps else None,
            "draft_share": sum(m["draft_s"] for m in measurements) / seconds if seconds else None,
            "verify_share": sum(m["verify_s"] for m in measurements) / seconds if seconds else None}


def write_report(results_path: Path, out: Path | None = None) -> Path:
    """`report.md` and the plots next to `results.json` (or in `out`); returns the report's path."""
    results = json.loads(Path(results_path).read_text())
    out = out or Path(results_path).parent
    summary = summarize(results)
    plots = write_plots(summary, out)
    trees = results.get("trees")
    if trees and trees["steps"]:
        from specserve.ablation.trees import draw_tree_shapes

        draw_tree_shapes(trees, out / "tree_shapes.png",
                         f"{trees['config']}: where the drafted trees put their nodes and where the target "
                         "accepted them")
        plots.append("tree_shapes")
    lines = [f"# Ablation: {results['config']['name']}", "", _caption(results), ""]
    lines += _category_table(summary)
    lines += _detail_table(summary)
    if any(c > 1 for by_load in summary["throughput"].values() for c in by_load):
        lines += _load_table(summary)
    lines += ["", *[f"![{name}]({name}.png)" for name in plots]]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return path


def _caption(results: dict) -> str:
    config, machine = results["config"], results["machine"]
    generation = config["generation"]
    return (f"{config['target']}, {config['dtype']}, {machine['threads']} threads on {machine['processor']} "
            f"(torch {results['versions']['torch']}); {len(results['prompts'])} prompts, {generation['max_tokens']} "
            f"new tokens, temperature {generation['temperature']}; {config['repeats']} repeat(s), medians; "
            f"speculation mode {config['engine'].get('speculation', 'fixed')}. Configurations read "
            "`drafter b<budget> <tree> k<top-k> [d<depth>]`. Speed-up: over no speculation in the same run.")


def _fmt(value, pattern: str = "{:.2f}", none: str = "-") -> str:
    return none if value is None else pattern.format(value)


def _category_table(summary: dict) -> list[str]:
    """Speed-up per category and configuration; the best configuration of each category in bold."""
    configs = [c for c in summary["configs"] if c != BASELINE_NAME and c in summary["per_category"]]
    if not configs:
        return []
    table = summary["per_category"]
    lines = ["## Speed-up over no speculation (MAT), concurrency 1", "",
             "| category | no-spec tok/s | " + " | ".join(configs) + " |",
             "|---|---:|" + "---:|" * len(configs)]
    for category in [*summary["categories"], "all"]:
        speedups = {c: table[c].get(category, {}).get("speedup") for c in configs}
        best = max((c for c in configs if speedups[c] is not None), key=lambda c: speedups[c], default=None)
        cells = []
        for c in configs:
            row = table[c].get(category, {})
            text = f"{_fmt(row.get('speedup'), '{:.2f}x')} ({_fmt(row.get('mat'))})"
            cells.append(f"**{text}**" if c == best else text)
        base = table.get(BASELINE_NAME, {}).get(category, {}).get("tok_s")
        name = "**all**" if category == "all" else category
        lines.append(f"| {name} | {_fmt(base, '{:.1f}')} | " + " | ".join(cells) + " |")
    return lines


def _detail_table(summary: dict) -> list[str]:
    agreement = summary.get("agreement", {})
    lines = ["", "## Per configuration, all prompts", "",
             "| configuration | tok/s | speed-up | MAT | drafted/step | acceptance by depth | draft time | "
             "verify time |" + (" same output as no-spec |" if agreement else ""),
             "|---|---:|---:|---:|---:|---|---:|---:|" + ("---:|" if agreement else "")]
    for config in summary["configs"]:
        row = summary["per_category"].get(config, {}).get("all")
        if row is None:
            continue
        depths = " / ".join(f"{a:.0%}" for a in row["acceptance_by_depth"][:6]) or "-"
        same = agreement.get(config)
        lines.append(f"| {config} | {row['tok_s']:.1f} | {_fmt(row['speedup'], '{:.2f}x')} | {_fmt(row['mat'])} | "
                     f"{_fmt(row['drafted_per_step'], '{:.1f}')} | {depths} | {_fmt(row['draft_share'], '{:.0%}')} | "
                     f"{_fmt(row['verify_share'], '{:.0%}')} |"
                     + ((f" {same['identical']}/{same['of']} ({same['prefix_share']:.0%})" if same else " -") + " |"
                        if agreement else ""))
    if agreement:
        lines += ["", "Same output as no-spec: greedy replies identical to the baseline's on the same prompt, and "
                  "(in brackets) the mean share of a reply before the first difference. Speculation is exact "
                  "in fp32, and in bf16 with chains; in a bf16 tree an accepted node reads its keys with "
                  "rejected siblings in between, which CPU attention may round differently from a one-token "
                  "decode, so where the target's top two tokens nearly tie either may win."]
    return lines


def _load_table(summary: dict) -> list[str]:
    loads = sorted({c for by_load in summary["throughput"].values() for c in by_load})
    lines = ["", "## Aggregate throughput by concurrency (tok/s, speed-up)", "",
             "| configuration | " + " | ".join(f"c={c}" for c in loads) + " |", "|---|" + "---:|" * len(loads)]
    for config, by_load in summary["throughput"].items():
        cells = [f"{by_load[c]['tok_s']:.1f} ({_fmt(by_load[c]['speedup'], '{:.2f}x')})" if c in by_load else "-"
                 for c in loads]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return lines


def write_plots(summary: dict, out: Path) -> list[str]:
    """The plots that have data: their names (PNG files in `out`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    configs = [c for c in summary["configs"] if c != BASELINE_NAME and c in summary["per_category"]]
    table = summary["per_category"]
    if configs and summary["categories"]:
        categories = summary["categories"]
        fig, ax = plt.subplots(figsize=(max(6.4, 0.6 * len(categories) * max(1, len(configs)) / 2), 4.2))
        width = 0.8 / len(configs)
        for i, config in enumerate(configs):
            values = [table[config].get(c, {}).get("speedup") or 0 for c in categories]
            ax.bar([x + i * width for x in range(len(categories))], values, width, label=config)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories, rotation=45, ha="right")
        ax.set_ylabel("speed-up over no speculation")
        ax.legend(fontsize=7)
        _save(fig, out / "speedup_by_category.png")
        written.append("speedup_by_category")

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for config in configs:
            depths = table[config]["all"]["acceptance_by_depth"]
            if depths:
                ax.plot(range(1, len(depths) + 1), depths, "o-", label=config)
        ax.set_xlabel("drafted depth d")
        ax.set_ylabel("share of verifying forwards accepting >= d")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
        _save(fig, out / "acceptance_by_depth.png")
        written.append("acceptance_by_depth")

        series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for config in configs:
            drafter, budget, *shape = config.split(" ")
            mat = table[config]["all"]["mat"]
            if mat is not None:
                series[" ".join([drafter, *shape])].append((int(budget[1:]), mat))
        if any(len(points) > 1 for points in series.values()):
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            for name, points in series.items():
                points.sort()
                ax.plot([b for b, _ in points], [m for _, m in points], "o-", label=name)
            ax.set_xlabel("tree budget (drafted nodes per step)")
            ax.set_ylabel("MAT (tokens per verifying forward)")
            ax.legend(fontsize=7)
            _save(fig, out / "mat_vs_budget.png")
            written.append("mat_vs_budget")

    throughput = summary["throughput"]
    if any(len(by_load) > 1 for by_load in throughput.values()):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for config, by_load in throughput.items():
            loads = sorted(by_load)
            ax.plot(loads, [by_load[c]["tok_s"] for c in loads], "o-", label=config)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate tok/s")
        ax.legend(fontsize=7)
        _save(fig, out / "throughput_vs_concurrency.png")
        written.append("throughput_vs_concurrency")
    return written


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
