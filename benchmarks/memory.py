"""Peak memory of a whole `specserve generate` process, and how long loading a pulled model takes.

Each measurement runs in a fresh child process, so its peak RSS (`ru_maxrss`) is its own.

    python benchmarks/memory.py [--model smollm2-135m-instruct] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
from pathlib import Path

from report import write_report
from tqdm import tqdm

RESULTS = Path(__file__).parent / "results"

# Times the first load in a process (one-time torch initialisation included) and a second one.
LOAD_PROBE = """
import json, sys, time
from specserve.models.loader import load_model
from specserve.pull import resolve_model
path = resolve_model(sys.argv[1], progress=False)
times = []
for _ in range(2):
    start = time.perf_counter()
    load_model(path, sys.argv[2])
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""

# Runs generate in a grandchild so the probe's own imports do not count towards the peak.
RSS_PROBE = """
import resource, subprocess, sys
result = subprocess.run([sys.executable, "-m", "specserve.cli", *sys.argv[1:]], capture_output=True)
if result.returncode:
    sys.exit(result.stderr.decode())
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def peak_rss_mb(model: str, dtype: str, max_tokens: int) -> float:
    args = ["generate", "Tell me a short story about a lighthouse.", "--target", model, "--dtype", dtype,
            "--max-tokens", str(max_tokens)]
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, *args], capture_output=True, text=True, check=True)
    return int(out.stdout.strip()) / 1024


def load_times_s(model: str, dtype: str) -> list[float]:
    out = subprocess.run([sys.executable, "-c", LOAD_PROBE, model, dtype], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS / "memory"))
    args = parser.parse_args()

    rows = []
    for dtype in tqdm(args.dtypes.split(","), desc="dtypes"):
        first, second = load_times_s(args.model, dtype)
        rows.append({"dtype": dtype, "peak_rss_mb": peak_rss_mb(args.model, dtype, args.max_tokens),
                     "first_load_s": first, "second_load_s": second})
    result = {"benchmark": "memory", "model": args.model, "max_tokens": args.max_tokens,
              "machine": platform.machine(), "python": platform.python_version(), "rows": rows,
              "self_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    write_report(
        args.out, result,
        f"`specserve generate --target {args.model} --max-tokens {args.max_tokens}`: peak RSS of the whole "
        "process; load time of a pulled model (first load in a process, then a second)",
        ["dtype", "peak RSS (MB)", "first load (s)", "second load (s)"],
        [[r["dtype"], f"{r['peak_rss_mb']:.0f}", f"{r['first_load_s']:.2f}", f"{r['second_load_s']:.2f}"]
         for r in rows],
    )

if __name__ == "__main__":
    main()
