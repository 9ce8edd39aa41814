"""Projection: fused small steps, per-block large steps, optional oneDNN packing -- same results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.models.linear import LARGE_STEP_TOKENS, Projection, packing_available


def make(sizes, pack: bool, bias: bool, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks = [(torch.randn(n, 96, generator=gen) * 0.05).to(dtype) for n in sizes]
    biases = [torch.randn(n, generator=gen).to(dtype) for n in sizes] if bias else None
    proj = Projection(96, sizes)
    proj.load(blocks, biases, pack=pack)
    return proj, blocks, biases


def per_block(x, blocks, biases):
    biases = biases or [None] * len(blocks)
    return torch.cat([F.linear(x, w, b) for w, b in zip(blocks, biases, strict=True)], dim=-1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [LARGE_STEP_TOKENS, 300])
def test_large_steps_are_exactly_one_matmul_per_block(bias, rows):
    """What transformers computes (separate q/k/v, gate/up), bit for bit."""
    for pack in (False, True) if packing_available(torch.bfloat16) else (False,):
        proj, blocks, biases = make([64, 32, 32], pack, bias)
        x = torch.randn(rows, 96).bfloat16()
        assert torch.equal(proj(x), per_block(x, blocks, biases))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 9, 64, LARGE_STEP_TOKENS - 1])
def test_small_steps_fuse_and_agree_with_per_block(bias, rows):
    x = torch.randn(rows, 96).bfloat16()
    plain, blocks, biases = make([64, 32, 32], False, bias)
    torch.testing.assert_close(plain(x), per_block(x, blocks, biases), atol=2e-2, rtol=2e-2)
    if packing_available(torch.bfloat16):
        packed, *_ = make([64, 32, 32], True, bias)
        assert packed.packed is not None and packed.fused is None
        torch.testing.assert_close(packed(x), plain(x), atol=2e-2, rtol=2e-2)


def test_unpacked_mode_keeps_one_copy_of_the_weights():
    proj, *_ = make([64, 32], False, False, dtype=torch.float32)
    assert all(b.untyped_storage().data_ptr() == proj.fused.untyped_storage().data_ptr() for b in proj.blocks)


def test_packing_is_only_for_bf16_on_cpu(monkeypatch):
    assert not packing_available(torch.float32)
    monkeypatch.setenv("SPECSERVE_PACKED_LINEAR", "0")
    assert not packing_available(torch.bfloat16)


def test_wrong_shapes_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        Projection(96, [64]).load([torch.zeros(64, 95)], None, pack=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_small_steps_approximate_and_large_steps_stay_exact(dtype, bias):
    """A draft model's int8 projections: close to the full-precision result (per-channel weight
    scales, activations quantized per call), in the model's dtype; large steps are untouched."""
    proj, blocks, biases = make([64, 32, 32], packing_available(dtype), bias, dtype=dtype)
    proj.quantize_int8()
    assert proj.int8 is not None and proj.packed is None
    for rows in (1, 9, LARGE_STEP_TOKENS - 1):
        x = torch.randn(rows, 96).to(dtype)
        got, expected = proj(x), per_block(x.float(), [b.float() for b in blocks],
                                           biases and [b.float() for b in biases])
        assert got.dtype == dtype and got.shape == expected.shape
        assert (got.float() - expected).norm() / expected.norm() < 0.03
    x = torch.randn(LARGE_STEP_TOKENS, 96).to(dtype)
    assert torch.equal(proj(x), per_block(x, blocks, biases))


@pytest.mark.parametrize("bias", [False, True])
def test_dense_blocks_give_each_weight_however_it_is_stored(bias):
    """Plain: the blocks themselves. Quantized: their exact values, block by block (what a tool
    copying a weight, such as a drafter head starting from a target layer, must see)."""
    proj, blocks, biases = make([64, 32, 32], False, bias, dtype=torch.float32)
    assert all(torch.equal(d, b) for d, b in zip(proj.dense_blocks(), blocks, strict=True))
    proj.requantize(8)
    dense = proj.dense_blocks()
    assert [tuple(d.shape) for d in dense] == [(64, 96), (32, 96), (32, 96)]
    exact = torch.cat([w.dequantize() for w in proj.quantized])
    assert torch.equal(torch.cat(dense), exact)
    assert torch.allclose(torch.cat(dense), torch.cat(blocks), atol=2e-3)  # int8 of values within +-0.25
    for got, want in zip(proj.dense_biases(), biases or [None] * 3, strict=True):
        assert (got is None and want is None) or torch.equal(got, want)
