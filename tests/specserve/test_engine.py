"""The engine on the real SmolLM2: batched greedy output equals transformers' generate, prompt by
prompt, under chunked prefill and under preemption; prefix caching computes only new tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.kv_cache import KVCache
from specserve.sampling import SamplingParams

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "data" / "spec_bench_16.jsonl"
MAX_TOKENS = 32
pytestmark = pytest.mark.slow


def spec_bench_prompts() -> list[str]:
    """16 Spec-Bench questions of mixed length (see tests/data/README.md)."""
    return [json.loads(line)["prompt"] for line in PROMPTS_FILE.read_text().splitlines()]


def make_engine(path, **options) -> LLMEngine:
    """The GGUF's exact fp32 weights: what transformers computes too."""
    return LLMEngine(path, dtype="float32", config=EngineConfig(**{"quantization": "none", **options}))


@pytest.fixture(scope="module")
def prompts_and_reference(smollm2_path):
    """Chat-formatted prompt ids, and what transformers generates for each alone (greedy, fp32)."""
    from specserve.models.loader import load_transformers

    engine = make_engine(smollm2_path, kv_cache_memory="16MiB")
    prompt_ids = [engine.encode(p, chat=True) for p in spec_bench_prompts()]
    hf = load_transformers(smollm2_path, torch.float32)
    reference = []
    for ids in prompt_ids:
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=sorted(engine.eos_ids), pad_token_id=0)
        reference.append(out[0, len(ids):].tolist())
    return prompt_ids, reference


def run_batch(engine: LLMEngine, prompt_ids: list[list[int]], params: SamplingParams) -> list:
    for i, ids in enumerate(prompt_ids):
        engine.add_request(str(i), ids, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            engine.check_invariants()
            if out.finished:
                done[out.request_id] = out
    engine.check_invariants()
    return [done[str(i)] for i in range(len(prompt_ids))]


def longest_sequence(prompt_ids) -> int:
    return max(len(ids) for ids in prompt_ids) + MAX_TOKENS


@pytest.mark.parametrize("case", ["default", "chunked-prefill", "preemption"])
def test_batched_greedy_equals_transformers_generate_alone(smollm2_path, prompts_and_reference, case):
    prompt_ids, reference = prompts_and_reference
    assert len({len(ids) for ids in prompt_ids}) > 8, "prompts of mixed lengths"
    options: dict = {}
    if case == "chunked-prefill":
        options = dict(max_num_batched_tokens=24, max_num_seqs=16)
    if case == "preemption":  # room for the longest sequence and a little more: far less than 16 need
        engine = make_engine(smollm2_path, kv_cache_memory="1MiB")
        per_block = KVCache.bytes_per_block(engine.model.config, 16, torch.float32)
        # admitted as vLLM admits (no room kept for growth), so that the pool runs out mid-reply
        options = dict(kv_cache_memory=per_block * (longest_sequence(prompt_ids) // 16 + 12),
                       schedule_conservativeness=0)
    engine = make_engine(smollm2_path, **options)
    outputs = run_batch(engine, prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    for i, (out, expected) in enumerate(zip(outputs, reference, strict=True)):
        assert out.outputs[0].token_ids == expected, f"prompt {i} ({len(prompt_ids[i])} tokens) differs"
        assert out.outputs[0].finish_reason == ("length" if len(expected) == MAX_TOKENS else "stop")
    preemptions = sum(o.metrics.num_preemptions for o in outputs)
    if case == "preemption":
        assert preemptions > 0, "the tiny pool should have forced preemptions"
    else:
        assert preemptions == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_cache_computes_only_the_new_tokens(smollm2_path):
    engine = make_engine(smollm2_path, kv_cache_memory="64MiB")
    prefix = engine.encode(spec_bench_prompts()[5] * 2)  # a long shared document
    first_ids = prefix + engine.encode(" Summarise it in one line.")
    second_ids = prefix + engine.encode(" What is the main point?")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = run_batch(engine, [first_ids], params)[0]
    assert first.metrics.num_cached_tokens == 0
    assert first.metrics.num_computed_tokens == len(first_ids) + 8 - 1

    second = run_batch(engine, [second_ids], params)[0]
    shared_full_blocks = (len(prefix) // 16) * 16
    assert second.metrics.num_cached_tokens == shared_full_blocks
    assert second.metrics.num_computed_tokens == len(second_ids) - shared_full_blocks + 8 - 1

    cold = run_batch(make_engine(smollm2_path, kv_cache_memory="64MiB", enable_prefix_caching=False),
                     [second_ids], params)[0]
    assert cold.metrics.num_computed_tokens == len(second_ids) + 8 - 1
    assert second.outputs[0].token_ids == cold.outputs[0].token_ids


def test_n_samples_share_the_prompt_blocks(smollm2_path):
    engine = make_engine(smollm2_path, kv_cache_memory="64MiB")
    ids = engine.encode(spec_bench_prompts()[5], chat=True)
    out = run_batch(engine, [ids], SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=6))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    tail = len(ids) - (len(ids) - 1) // 16 * 16  # what each later sample computes itself
    assert out.metrics.num_computed_tokens <= len(ids) + 3 * tail + 4 * 6
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "seeded samples differ from each other"
