"""The kernels' AVX2 and portable paths, built here for those instruction sets: a CI host may be
any of them, and this one would only ever take its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ["tests/kernels/test_block_matmul.py", "tests/kernels/test_cpu_attention.py",
                "tests/kernels/test_rms_norm.py", "tests/kernels/test_rope_kv.py", "tests/kernels/test_activation.py",
                "tests/kernels/test_sampling_rows.py"]
# The tiled kernels' products of fixed weights and activations and tree attention over a fixed
# cache (head sizes 64 and 128: the vector paths; fp32 and bf16), saved to the path given.
VECTOR_RESULTS = """
import random, sys, torch
from kernels.native import kquant_tiled_matmul, tiled_matmul
from specserve.models.gguf import decode_blocks, tile_blocks, tile_super_blocks, tiled_bits
from tests.kernels.test_cpu_attention import attend
from tests.kernels.test_reference import paged_cache, random_tree
from tests.specserve.models.test_gguf import random_blocks
torch.manual_seed(0)
x = torch.randn(7, 512) * torch.logspace(-2, 2, 7).unsqueeze(1)
steps = {"7 rows": x, "19 rows": torch.randn(19, 512)}  # 19: AMX tiles where the host has them
out = {}
for head_size in (64, 128):
    rng = random.Random(head_size)
    requests = [(37, random_tree(rng, 7, "random")), (150, random_tree(rng, 1, "chain"))]
    tables, k_cache, v_cache = paged_cache(rng, requests, 4, 2, head_size, torch.float32)
    q = torch.randn(8, 6, head_size)
    for dtype in (torch.float32, torch.bfloat16):
        out[f"attention {head_size} {dtype}"] = attend([t for _, t in requests], [c for c, _ in requests], tables,
                                                       k_cache.to(dtype), v_cache.to(dtype), q.to(dtype))
for name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"):
    w = decode_blocks(random_blocks(name, 32, 512), name, 32)
    tiles = tile_super_blocks(w) if name.endswith("_K") else tile_blocks(w.values(), w.scale, w.min, w.bits)
    for rows, x in steps.items():
        if name.endswith("_K"):
            out[f"{name} {rows}"] = kquant_tiled_matmul(x, *tiles, w.bits)
        else:
            out[f"{name} {rows}"] = tiled_matmul(x, *tiles, tiled_bits(w.bits))
torch.save(out, sys.argv[1])
"""


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
    # ...and the vector kernels give this host's own kernels' bits (the same float steps per lane):
    # a model gives the same outputs on any CPU
    theirs, ours = tmp_path / "theirs.pt", tmp_path / "ours.pt"
    native = {k: v for k, v in os.environ.items() if k != "SPECSERVE_CPU_MARCH"}
    for path, environment in ((theirs, env), (ours, native)):
        done = subprocess.run([sys.executable, "-c", VECTOR_RESULTS, str(path)], cwd=ROOT, env=environment,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    expected, got = torch.load(ours), torch.load(theirs)
    for name, product in expected.items():
        assert torch.equal(got[name], product), name
