"""benchmarks/cpu_attention.py runs end to end and records both contenders on every step kind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_attention.py"


def test_cpu_attention_benchmark_writes_json_and_markdown(tmp_path):
    out = tmp_path / "cpu-attention"
    subprocess.run([sys.executable, str(SCRIPT), "--repeats", "1", "--warmup", "0", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(Path(f"{out}.json").read_text())
    records = result["records"]
    assert {r["dtype"] for r in records} == {"float32", "bfloat16", "int8"} and len(records) == 18
    for record in records:
        assert record["ours_us"] > 0 and record["sdpa_us"] > 0
        assert record["max_abs_difference"] < (2e-2 if record["dtype"] == "bfloat16" else 1e-5)  # the same attention
    assert "| dtype | step | ours us |" in Path(f"{out}.md").read_text()


def test_against_a_revision_times_that_revision_s_kernel_beside_ours(tmp_path):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=SCRIPT.parent, capture_output=True).returncode != 0:
        pytest.skip("needs the repository's git history")
    out = tmp_path / "cpu-attention"
    subprocess.run([sys.executable, str(SCRIPT), "--repeats", "1", "--warmup", "0", "--dtypes", "float32",
                    "--against", "HEAD", "--out", str(out)], check=True, capture_output=True, text=True, timeout=600)
    result = json.loads(Path(f"{out}.json").read_text())
    assert result["against"] == "HEAD" and len(result["records"]) == 6
    assert all(record["against_us"] > 0 for record in result["records"])
    assert "| HEAD us | ours / HEAD |" in Path(f"{out}.md").read_text()
