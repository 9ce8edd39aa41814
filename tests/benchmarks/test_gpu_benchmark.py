"""benchmarks/gpu.py, in its smoke mode on the CPU: every section runs and reports (the real run
needs a GPU; this keeps the script working between the times one is lent)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


def test_gpu_benchmark_smoke_writes_json_markdown_and_a_plot(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--out", str(tmp_path)],
                         check=True, capture_output=True, text=True, timeout=600)
    assert "torch" in run.stdout and "triton" in run.stdout  # the versions it ran on
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["kernel"] and all(r["ours_us"] > 0 and r["sdpa_masked_us"] > 0 for r in result["kernel"])
    configs = {r["config"] for r in result["engine"]}
    assert {"none", "replay:0.8 chain", "replay:0.8 tree", "draft 160M (dummy)", "transformers static cache"} <= configs
    assert all(r["tok_s"] > 0 for r in result["engine"])
    assert (tmp_path / "gpu.png").stat().st_size > 0 and "| batch | config |" in (tmp_path / "gpu.md").read_text()


def test_without_a_gpu_the_full_run_says_to_use_one(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "CUDA machine" in run.stderr
