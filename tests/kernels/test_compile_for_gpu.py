"""The Triton kernels compile for a Hopper GPU (sm_90), checked on any machine: the interpreter
the other kernel tests use on a CPU accepts code the compiler refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("compile_for_gpu.py")


def test_every_kernel_case_and_tuning_config_compiles_to_a_cubin_for_sm_90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--arch", "90", "--all-configs"], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    compiled = [line for line in done.stdout.splitlines() if line.startswith("compiled  ")]
    for kernel in ("attention", "write_kv", "compact_kv"):
        for cache in ("fp32", "bf16", "int8", "fp8"):
            assert any(line.startswith(f"compiled  {kernel} ") and f"cache={cache}" in line for line in compiled), \
                (kernel, cache)
    assert sum(line.startswith("compiled  attention config ") for line in compiled) > 1  # the tuning configs
