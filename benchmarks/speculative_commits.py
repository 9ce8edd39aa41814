"""`speculative.py --parts c` at two commits in one run: a repeat of one, then a repeat of the
other, round after round, so that the VM's drift (tok/s of one configuration varies by a quarter
between repeats minutes apart) falls on both alike. "before" is the commit `--before`, checked
out into a git worktree and run with its own code; "after" is this tree. Each repeat runs in a
process of its own (one repeat of every concurrency level); the report gives, per level, the
median over rounds of each commit's plain and speculative tok/s and ratio, and after / before.

    python benchmarks/speculative_commits.py [--before 4ef4467] [--rounds 3] [--concurrency 1,8,32,64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from report import write_report
from tqdm import tqdm
from verify import worktree

RESULTS = Path(__file__).parent / "results"
SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_questions.jsonl"


def one_repeat(path: Path, concurrency: str, questions: Path, out: Path) -> dict:
    """One repeat of part c with the code at `path`: its summary by concurrency level."""
    env = {**os.environ, "PYTHONPATH": str(path)}
    subprocess.run([sys.executable, str(path / "benchmarks" / "speculative.py"), "--parts", "c", "--repeats", "1",
                    "--concurrency", concurrency, "--questions", str(questions), "--out", str(out)],
                   env=env, cwd=path, check=True, capture_output=True, text=True)
    return json.loads(Path(f"{out}-c.json").read_text())["summary"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="4ef4467", help="the commit to compare this tree with")
    parser.add_argument("--rounds", type=int, default=3, help="repeats of each commit, taking turns")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH, help="Spec-Bench questions (jsonl)")
    parser.add_argument("--out", default=str(RESULTS / "speculative-commits"))
    args = parser.parse_args()
    from specserve.machine import processor_name

    sides = {"before": worktree(args.before), "after": Path(__file__).resolve().parents[1]}
    samples: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in tqdm(range(args.rounds), desc="rounds"):
            for side, path in sides.items():
                out = Path(scratch) / f"{side}-{round_}"
                samples[side].append(one_repeat(path, args.concurrency, args.questions.resolve(), out))
    rows, table = [], []
    for level in args.concurrency.split(","):
        row: dict = {"concurrent": int(level)}
        for side in sides:
            for key in ("no-spec tok/s", "spec tok/s", "ratio"):
                row[f"{side} {key}"] = statistics.median(s[level][key] for s in samples[side])
        row["after/before no-spec"] = row["after no-spec tok/s"] / row["before no-spec tok/s"]
        row["after/before spec"] = row["after spec tok/s"] / row["before spec tok/s"]
        rows.append(row)
        rates = [f"{row[f'{side} {key}']:.1f}" for side in sides for key in ("no-spec tok/s", "spec tok/s")]
        ratios = [f"{row[key]:.2f}x" for key in ("before ratio", "after ratio", "after/before no-spec",
                                                 "after/before spec")]
        table.append([level, *rates, *ratios])
    result = {"benchmark": "speculative part c, two commits", "before": args.before, "rounds": args.rounds,
              "machine": processor_name(), "rows": rows, "samples": samples}
    write_report(args.out, result,
                 f"`speculative.py --parts c` at {args.before} (before) and this tree (after), a repeat of each in "
                 f"turn, {args.rounds} rounds, medians; {processor_name()}",
                 ["concurrent", "before no-spec tok/s", "before spec tok/s", "after no-spec tok/s", "after spec tok/s",
                  "before ratio", "after ratio", "after/before no-spec", "after/before spec"], table)


if __name__ == "__main__":
    main()
