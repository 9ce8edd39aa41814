"""The KV pool: its layout per dtype (int8 rows carry their scale), what a block costs, compaction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels import reference
from specserve.closed_loop import ClosedLoop, run_to_completion
from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.kv_cache import KVCache
from specserve.sampling import SamplingParams


def config(head_dim: int = 64) -> SimpleNamespace:
    """What the pool reads of a model's config: 3 layers, 2 K/V heads."""
    return SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=head_dim)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_an_int8_block_costs_about_half_of_bf16_and_a_quarter_of_fp32(head_dim):
    """Scales included: what lets an int8 pool hold 1.9x the tokens of bf16 in the same bytes."""
    block = {dtype: KVCache.bytes_per_block(config(head_dim), 16, dtype)
             for dtype in (torch.float32, torch.bfloat16, torch.int8)}
    assert block[torch.int8] == 2 * 3 * 16 * 2 * (head_dim + head_dim // 32)  # a scale byte per 32 channels
    assert block[torch.bfloat16] / block[torch.int8] >= 1.9
    assert block[torch.float32] / block[torch.int8] >= 3.8
    cache = KVCache.for_model(config(head_dim), 5, 16, torch.int8)
    assert cache.k.shape == (3, 5, 16, 2, head_dim + head_dim // 32) and cache.k.dtype == torch.int8
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


def test_in_the_same_memory_an_int8_pool_runs_about_twice_the_requests_at_once(dummy_model):
    """Under a closed loop of more clients than the pool holds, the scheduler's running count in
    the steady state follows the pool's tokens (what `engine.py --memory-bound` measures)."""
    model = dummy_model(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)  # head_dim 64

    def steady_running_count(kv_cache_dtype: str) -> float:
        engine = LLMEngine(model, "float32", EngineConfig(kv_cache_memory="1MiB", kv_cache_dtype=kv_cache_dtype,
                                                         speculation="off", load_format="dummy", max_num_seqs=64))
        prompts = [[3 + (i + j) % 300 for j in range(48)] for i in range(64)]
        loop = ClosedLoop(engine, prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                          concurrency=64, steps=240)
        running = []
        while not loop.done:
            loop.step()
            running.append(len(engine.scheduler.running))
        assert len(loop.finished) > 2 * max(running[120:])  # requests finished and were replaced: a steady state
        return sum(running[120:-1]) / len(running[120:-1])

    bf16, int8 = steady_running_count("bf16"), steady_running_count("int8")
    assert bf16 >= 8 and int8 >= 1.8 * bf16


def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4'.*auto, fp32, bf16, int8, fp8"):
        EngineConfig(kv_cache_dtype="int4")


def test_fp8_on_a_cpu_is_refused_with_what_to_use_instead():
    with pytest.raises(ValueError, match="fp8 needs a GPU.*--kv-cache-dtype int8"):
        EngineConfig(kv_cache_dtype="fp8", device="cpu")


@pytest.mark.parametrize("name, model_dtype, pool_dtype", [
    ("auto", torch.float32, torch.float32), ("auto", torch.bfloat16, torch.bfloat16),
    ("bf16", torch.float32, torch.bfloat16), ("fp32", torch.bfloat16, torch.float32),
    ("int8", torch.float32, torch.int8), ("fp8", torch.bfloat16, torch.float8_e4m3fn)])
def test_the_pool_dtype_is_named_or_the_models_own(name, model_dtype, pool_dtype):
    assert EngineConfig.kv_dtype(SimpleNamespace(kv_cache_dtype=name), model_dtype) == pool_dtype


def test_an_fp32_model_over_a_bf16_pool_serves_greedy_replies_like_its_speculation(smollm2_path):
    """--kv-cache-dtype bf16 under the CPU's fp32 model: the C++ write and attention round and widen
    the pool's values, and speculation stays lossless over it."""
    def replies(**overrides) -> list[list[int]]:
        config = EngineConfig(kv_cache_memory="32MiB", kv_cache_dtype="bf16", **overrides)
        engine = LLMEngine(smollm2_path, None, config)
        assert engine.kv_cache.k.dtype == torch.bfloat16 and engine.model.dtype == torch.float32
        prompts = [engine.encode(p, chat=True) for p in ("Name three rivers.", "Count from one to ten in words.")]
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in run_to_completion(engine, prompts, greedy)[0]]

    assert replies(speculation="off") == replies(draft="ngram", speculation="fixed")
