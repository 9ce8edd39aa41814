"""How long `specserve serve` takes to answer `/health`: the first start (weights read from the
GGUF and prepared for this CPU's kernels, the step cost calibrated) and a later one (prepared
weights memory-mapped, the calibration reused), with this tree and, with `--against REV`, the
code of a git revision (checked out beside the repository, `verify.worktree`), taking turns in one run.

Every start gets a cache directory of its own holding links to the user cache's pulled models
and built kernels (built before the clock starts), so a first start prepares and calibrates
from nothing and the later start reuses just what the first one wrote.

    python benchmarks/startup.py [--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct]
                                 [--against REV] [--repeats 2]

Writes `results/startup.{json,md}`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from peers import Server, started
from report import write_report
from tqdm import tqdm
from verify import worktree

from drafters.spec import parse_spec
from specserve.machine import processor_name
from specserve.pull import CACHE_ENV, cache_dir, resolve_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"


def fresh_cache(root: Path) -> Path:
    """An empty cache but for links to the user cache's models and kernels."""
    cache = Path(tempfile.mkdtemp(prefix="startup-cache-"))
    for shared in ("models", "kernels"):
        (root / shared).mkdir(parents=True, exist_ok=True)
        (cache / shared).symlink_to(root / shared, target_is_directory=True)
    return cache


def server(code: Path, cache: Path, args) -> Server:
    env = {"PYTHONPATH": str(code), CACHE_ENV: str(cache), "OMP_NUM_THREADS": "2"}
    return Server(code.name, [sys.executable, "-m", "specserve.cli", "serve", "--target", args.target,
                              "--draft", args.draft, "--log-level", "warning"], env=env)


def starts(code: Path, args) -> tuple[float, float]:
    """Seconds to `/health` of a first start and of the later start after it."""
    cache = fresh_cache(cache_dir())
    try:
        contender = server(code, cache, args)
        subprocess.run([sys.executable, "-c", "from kernels import native; native.load()"], cwd=code, check=True,
                       env={**os.environ, **contender.env})  # built (or found) before the clock starts
        with started(contender) as (_, first):
            pass
        with started(contender) as (_, later):
            pass
        return first, later
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct",
                        help="a drafter spec (a model, ngram+suffix, ...)")
    parser.add_argument("--against", metavar="REV", help="also start the server as it was at this git revision")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "startup"))
    args = parser.parse_args()
    for name in [args.target, *(part.arg for part in parse_spec(args.draft) if part.kind == "model")]:
        resolve_model(name)  # pulled before anything is timed
    names = ["ours"] + ([args.against] if args.against else [])
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    codes = {"ours": ROOT, **({args.against: worktree(args.against)} if args.against else {})}
    for repeat in tqdm(range(args.repeats), desc="startup", unit="round"):
        for name in names[repeat % len(names):] + names[: repeat % len(names)]:  # each goes first in turn
            times[name].append(starts(codes[name], args))
    records = [{"code": name, "first_s": statistics.median(t[0] for t in times[name]),
                "later_s": statistics.median(t[1] for t in times[name]), "runs": times[name]} for name in names]
    columns = ["code", "first start s", "later start s"]
    rows = [[r["code"], f"{r['first_s']:.1f}", f"{r['later_s']:.1f}"] for r in records]
    if args.against:
        base = records[1]
        columns += [f"first / {args.against}", f"later / {args.against}"]
        for row, record in zip(rows, records, strict=True):
            row += [f"{record['first_s'] / base['first_s']:.2f}x", f"{record['later_s'] / base['later_s']:.2f}x"]
    machine = processor_name()
    caption = (f"`specserve serve --target {args.target} --draft {args.draft}` until `/health` answers, on "
               f"`{machine}` (2 threads): a first start (weights prepared, step cost calibrated) and the later "
               f"start after it; median of {args.repeats}, the contenders taking turns.")
    write_report(args.out, {"machine": machine, "target": args.target, "draft": args.draft, "against": args.against,
                            "repeats": args.repeats, "records": records}, caption, columns, rows)


if __name__ == "__main__":
    main()
