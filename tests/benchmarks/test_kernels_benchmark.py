"""benchmarks/kernels.py runs end to end (on a CPU through the interpreter: a smoke test of the
script itself; its measurements are only meaningful on a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


def test_kernel_benchmark_writes_json_and_markdown(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "kernels"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--batches", "2", "--contexts", "40", "--trees", "1", "16",
         "--heads", "8", "--kv-heads", "2", "--head-dim", "64", "--out", str(out)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    result = json.loads(Path(f"{out}.json").read_text())
    assert [(r["batch"], r["context"], r["tree"]) for r in result["results"]] == [(2, 40, 1), (2, 40, 16)]
    for record in result["results"]:
        assert record["max_abs_error"] < 2e-2  # bf16 kernel vs the reference
        assert set(record["ms"]) >= {"kernel", "sdpa", "reference"}
        assert record["kv_bytes"] == 2 * (40 + record["tree"]) * 2 * 64 * 2 * 2
    assert "| batch | context | tree |" in Path(f"{out}.md").read_text()
