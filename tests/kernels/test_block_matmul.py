"""The quantized CPU kernels (groups of 32: Q4_0, Q4_1, Q5_0, Q8_0; K-quant super-blocks: Q4_K,
Q6_K): the arithmetic they promise, and rows that never depend on each other."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kernels.native import (
    isa,
    kquant_matmul,
    kquant_tiled_matmul,
    library_path,
    silu_mul,
    tiled_matmul,
    tiled_swiglu,
)
from specserve.models.gguf import decode_blocks, tile_blocks, tile_super_blocks, tiled_bits
from tests.specserve.models.test_gguf import random_blocks

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "Q8_0"]


def quantized_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """What the kernel multiplies: x rounded to int8 per block of inputs with scale max|x| / 127,
    in the kernel's own float32 steps (a double-precision quotient rounds some halves otherwise)."""
    blocks = x.float().view(x.shape[0], -1, block)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale == 0, 0, 1 / scale)
    return (torch.round(blocks * inverse).double() * scale.double()).view_as(x)


def run(x, weight):
    return weight.matmul(x)


def test_the_build_names_its_instruction_path():
    assert isa() in {"avx512-vnni+amx", "avx512-vnni", "avx2+vnni", "avx2", "portable"}


def functions_using(library: Path, names: tuple[str, ...], instructions: str) -> dict[str, str]:
    """The functions in `library` (demangled name: disassembly) whose name holds one of `names`
    and whose code uses an instruction matching the pattern `instructions`."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", str(library)], capture_output=True,
                             text=True, check=True).stdout
    functions = {}
    for body in re.split(r"\n(?=[0-9a-f]+ <)", listing):
        name = body.split("\n", 1)[0]
        if any(part in name for part in names) and re.search(rf"\b({instructions})\b", body):
            functions[name] = body
    return functions


def tile_functions(library: Path) -> dict[str, str]:
    """The tiled kernel's functions in `library` that multiply codes."""
    return functions_using(library, ("tile_rows<", "tiled_impl<"), "vpdpbusd|vpmaddubsw|tdpbsud")


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_the_tiled_kernels_prefetch_the_weights_they_read_next():
    # A call is too short for the hardware prefetcher alone; GCC once dropped the helper's call (out
    # of line, it looked free of side effects) and a SmolLM2 decode ran 7% slower unnoticed.
    if isa() == "portable":
        pytest.skip("the portable path has no prefetches")
    functions = tile_functions(library_path())
    assert functions, "no tiled kernel found in the library"
    for name, body in functions.items():
        assert re.search(r"\bprefetcht[01]\b", body), f"{name} reads its weights without prefetching them"


@pytest.mark.parametrize("type_name", FORMATS)
@pytest.mark.parametrize("odd_spans", [False, True])  # 512-bit kernels pair 32-column spans
@pytest.mark.parametrize("rows", [40, 48])  # 48: whole tiles of 16 rows (the tiled layout, where the CPU has it)
def test_computes_quantized_activations_times_the_dequantized_weights(type_name, odd_spans, rows):
    if odd_spans and type_name.endswith("_K"):
        pytest.skip("K-quant rows are whole 256-column blocks: always an even number of spans")
    cols = 96 if odd_spans else 768
    weight = decode_blocks(random_blocks(type_name, rows, cols), type_name, rows)
    x = torch.randn(5, cols)
    expected = quantized_activations(x, weight.activation_block) @ weight.dequantize().double().T
    got = run(x, weight).double()
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # ...which stays close to the exact product (activation rounding is the only approximation)
    exact = x.double() @ weight.dequantize().double().T
    assert (got - exact).norm() / exact.norm() < 0.03


@pytest.mark.parametrize("type_name", FORMATS)
@pytest.mark.parametrize("rows", [33, 32])
def test_each_row_is_computed_as_if_alone(type_name, rows):
    cols = 512 if type_name.endswith("_K") else 544  # 17 spans: the odd path too
    weight = decode_blocks(random_blocks(type_name, rows, cols), type_name, rows)
    x = torch.randn(70, cols) * torch.logspace(-2, 2, 70).unsqueeze(1)
    alone = torch.cat([run(x[i:i + 1], weight) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 8, 9, 10, 11, 16, 17, 24, 64, 70):  # from 11 rows: AMX tiles where the host has them
        assert torch.equal(run(x[:rows], weight), alone[:rows])


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q6_K"])
def test_zero_rows_and_zero_activations(type_name):
    weight = decode_blocks(random_blocks(type_name, 8, 256), type_name, 8)
    assert run(torch.zeros(0, 256), weight).shape == (0, 8)
    assert torch.equal(run(torch.zeros(2, 256), weight), torch.zeros(2, 8))


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q6_K"])
def test_refuses_what_it_cannot_compute(type_name):
    weight = decode_blocks(random_blocks(type_name, 8, 256), type_name, 8)
    with pytest.raises(RuntimeError, match="float32"):
        run(torch.randn(2, 256, dtype=torch.float64), weight)
    with pytest.raises(RuntimeError, match="do not fit"):
        run(torch.randn(2, 288), weight)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_the_tiled_layout_computes_what_the_blocks_do(type_name):
    """Called directly, so that every instruction path checks its own version of it."""
    weight = decode_blocks(random_blocks(type_name, 32, 160), type_name, 32)
    x = torch.randn(11, 160)
    tiles = tile_blocks(weight.values(), weight.scale, weight.min, weight.bits)
    tiled = tiled_matmul(x, *tiles, tiled_bits(weight.bits))
    expected = quantized_activations(x, 32) @ weight.dequantize().double().T
    assert torch.allclose(tiled.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert torch.equal(torch.cat([tiled_matmul(x[i:i + 1], *tiles, tiled_bits(weight.bits)) for i in range(len(x))]),
                       tiled)
    # the file's bytes per 32 weights and at most an fp16 minimum more (4- and 5-bit codes packed)
    assert sum(t.numel() * t.element_size() for t in tiles) <= 32 * 160 * {4: 20, 5: 24, 8: 36}[weight.bits] // 32


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_0", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 11, 17, 40])  # from 11 rows: AMX tiles where the host has them
def test_the_tiled_swiglu_is_silu_mul_of_the_tiled_product(type_name, rows):
    """The decoder stack's gate/up projection and SwiGLU in one op: the two ops' very bits."""
    weight = decode_blocks(random_blocks(type_name, 64, 160), type_name, 64)  # gate's 32 outputs, then up's
    tiles = tile_blocks(weight.values(), weight.scale, weight.min, weight.bits)
    x = torch.randn(rows, 160) * 4
    fused = tiled_swiglu(x, *tiles, tiled_bits(weight.bits))
    assert fused.shape == (rows, 32)
    assert torch.equal(fused, silu_mul(tiled_matmul(x, *tiles, tiled_bits(weight.bits))))


def test_the_tiled_swiglu_needs_as_many_up_tiles_as_gate_tiles():
    weight = decode_blocks(random_blocks("Q4_1", 48, 64), "Q4_1", 48)
    tiles = tile_blocks(weight.values(), weight.scale, weight.min, weight.bits)
    with pytest.raises(RuntimeError, match="as many tiles"):
        tiled_swiglu(torch.randn(2, 64), *tiles, tiled_bits(weight.bits))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_the_k_quant_kernels_compute_what_the_super_blocks_hold(type_name):
    """Both K-quant kernels called directly (every instruction path has its own version of each)."""
    weight = decode_blocks(random_blocks(type_name, 32, 512), type_name, 32)
    x = torch.randn(7, 512)
    expected = quantized_activations(x, 256) @ weight.dequantize().double().T
    native = kquant_matmul(x, weight.codes, weight.high, weight.sub_scale, weight.sub_min, weight.d, weight.dmin,
                           weight.bits)
    tiled = kquant_tiled_matmul(x, *tile_super_blocks(weight), weight.bits)
    for got in (native, tiled):
        assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert torch.equal(torch.cat([kquant_tiled_matmul(x[i:i + 1], *tile_super_blocks(weight), weight.bits)
                                  for i in range(len(x))]), tiled)
