"""The kernels' AVX2 and portable paths, built here for those instruction sets: a CI host may be
any of them, and this one would only ever take its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ["tests/kernels/test_block_matmul.py", "tests/kernels/test_cpu_attention.py",
                "tests/kernels/test_rms_norm.py", "tests/kernels/test_rope_kv.py",
                "tests/kernels/test_sampling_rows.py"]


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 instruction sets")
@pytest.mark.parametrize("march, isa", [("haswell", "avx2"), ("x86-64", "portable")])
def test_every_instruction_path_passes_the_kernel_tests(march, isa, tmp_path):
    env = {**os.environ, "SPECSERVE_CPU_MARCH": march, "SPECSERVE_CACHE_DIR": str(tmp_path)}
    check = subprocess.run([sys.executable, "-c", "from kernels import native; print(native.isa())"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip() == isa
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:]
