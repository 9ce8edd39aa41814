"""The C++ rotary + K/V write: the torch path's very bits, in one pass."""

from __future__ import annotations

import pytest
import torch

from kernels import native, reference
from specserve.models.config import RopeConfig
from specserve.models.rope import RotaryEmbedding, apply_rotary

HEADS, KV_HEADS, HEAD_DIM, BLOCKS, BLOCK_SIZE = 9, 3, 64, 6, 16


def torch_path(qkv, cos, sin, k_cache, v_cache, slots):
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    tokens = qkv.shape[0]
    q = apply_rotary(q.view(tokens, HEADS, HEAD_DIM), cos, sin)
    k = apply_rotary(k.view(tokens, KV_HEADS, HEAD_DIM), cos, sin)
    reference.write_kv(k, v.view(tokens, KV_HEADS, HEAD_DIM), k_cache, v_cache, slots)
    return q


@pytest.mark.parametrize("tokens", [1, 8, 37])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_equals_the_torch_path_bit_for_bit(tokens, cache_dtype):
    """bf16 and int8 caches too: bf16 rounded to nearest even as torch rounds; int8 the same codes
    and scales as the reference's quantization of the same K/V."""
    rotary = RotaryEmbedding(RopeConfig(theta=100000.0), HEAD_DIM, 4096, torch.float32)
    positions = torch.randint(0, 4096, (tokens,))
    cos, sin = rotary(positions)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM) * 4
    qkv[:, -KV_HEADS * HEAD_DIM:][0] = 0  # a row of zeros: scale 0
    slots = torch.randperm(BLOCKS * BLOCK_SIZE)[:tokens]
    caches = [torch.randn(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM) for _ in range(2)]
    caches = [reference.quantize_kv(c) if cache_dtype == torch.int8 else c.to(cache_dtype) for c in caches]
    mine = [c.clone() for c in caches]
    expected = torch_path(qkv, cos, sin, *caches, slots)
    q = native.rope_write_kv(qkv, cos, sin, *mine, slots, HEADS, KV_HEADS)
    assert torch.equal(q, expected)
    assert torch.equal(mine[0], caches[0]) and torch.equal(mine[1], caches[1])  # every other slot untouched too


def test_a_slot_outside_the_cache_is_refused():
    cache = torch.zeros(1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    qkv, trig = torch.zeros(1, (HEADS + 2 * KV_HEADS) * HEAD_DIM), torch.ones(1, 1, HEAD_DIM)
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.rope_write_kv(qkv, trig, trig, cache, cache.clone(), torch.tensor([BLOCK_SIZE]), HEADS, KV_HEADS)
