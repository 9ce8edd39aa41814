"""The KV pool: its layout per dtype (int8 rows carry their scale), what a block costs, compaction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels import reference
from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.kv_cache import KVCache


def config(head_dim: int = 64) -> SimpleNamespace:
    """What the pool reads of a model's config: 3 layers, 2 K/V heads."""
    return SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=head_dim)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_an_int8_block_costs_about_half_of_bf16_and_a_quarter_of_fp32(head_dim):
    """Scales included: what lets an int8 pool hold 1.9x the tokens of bf16 in the same bytes."""
    block = {dtype: KVCache.bytes_per_block(config(head_dim), 16, dtype)
             for dtype in (torch.float32, torch.bfloat16, torch.int8)}
    assert block[torch.int8] == 2 * 3 * 16 * 2 * (head_dim + reference.INT8_SCALE_BYTES)
    assert block[torch.bfloat16] / block[torch.int8] >= 1.9
    assert block[torch.float32] / block[torch.int8] >= 3.8
    cache = KVCache.for_model(config(head_dim), 5, 16, torch.int8)
    assert cache.k.shape == (3, 5, 16, 2, head_dim + 2) and cache.k.dtype == torch.int8
    assert 2 * cache.k.numel() == 5 * block[torch.int8]


def test_compaction_moves_int8_rows_with_their_scales():
    cache = KVCache.for_model(config(), 4, 4, torch.int8)
    values = torch.randn(3, 16, 2, 64) * torch.arange(1, 17).view(1, 16, 1, 1)
    for layer in range(3):
        cache.k[layer].view(-1, 2, 66).copy_(reference.quantize_kv(values[layer]))
    before = reference.dequantize_kv(cache.k.clone(), torch.float32).view(3, -1, 2, 64)
    cache.compact([9, 12], [5, 6])
    after = reference.dequantize_kv(cache.k, torch.float32).view(3, -1, 2, 64)
    assert torch.equal(after[:, [5, 6]], before[:, [9, 12]])
    assert torch.equal(after[:, :5], before[:, :5])


def test_an_int8_pool_admits_about_twice_the_tokens_of_bf16_in_the_same_memory(smollm2_path):
    def pool(kv_cache_dtype: str) -> LLMEngine:  # SmolLM2's shape (head_dim 64), random weights: quick
        return LLMEngine(smollm2_path, "bfloat16", EngineConfig(kv_cache_memory="16MiB", kv_cache_dtype=kv_cache_dtype,
                                                                speculation="off", load_format="dummy"))

    bf16, int8 = pool("auto"), pool("int8")
    assert bf16.kv_cache.k.dtype == torch.bfloat16 and int8.kv_cache.k.dtype == torch.int8
    assert int8.num_kv_tokens >= 1.9 * bf16.num_kv_tokens
    assert int8.info["kv_cache_dtype"] == "int8"


def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8'.*auto, int8"):
        EngineConfig(kv_cache_dtype="fp8")
