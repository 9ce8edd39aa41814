"""The engine's bookkeeping on a tiny random model: requests come and go at any step (aborts,
preemptions, completions) and no KV block is ever lost; bad requests are refused up front."""

from __future__ import annotations

import gc
import random

import pytest

from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.sampling import SamplingParams


def make_engine(path, **options) -> LLMEngine:
    return LLMEngine(path, dtype="float32", config=EngineConfig(**options))


@pytest.mark.parametrize("seed", range(6))
def test_random_submits_aborts_and_preemptions_leave_no_block_behind(tiny_chat_model, seed):
    rng = random.Random(seed)
    # Per token 512 bytes in fp32 (2 layers, K and V, 2 KV heads of 16), 136 in int8 (16 codes and a
    # scale byte per head; odd seeds): a pool of 100-250 tokens, so requests collide
    kv_cache_dtype, token_bytes = ("int8", 2 * 2 * 2 * 17) if seed % 2 else ("auto", 512)
    engine = make_engine(tiny_chat_model, block_size=rng.choice([4, 8, 16]), kv_cache_dtype=kv_cache_dtype,
                         kv_cache_memory=rng.randint(100, 250) * token_bytes,
                         max_num_seqs=rng.choice([4, 8]), max_num_batched_tokens=rng.choice([8, 24, 64]),
                         schedule_conservativeness=[0.0, 1.0, 2.0][seed % 3])  # 0: admitted as vLLM admits
    preemptions = 0
    bm = engine.block_manager
    shared = [rng.randrange(3, 49000) for _ in range(40)]
    finish_reasons: dict[str, str] = {}
    submitted = 0
    for _ in range(120):
        if rng.random() < 0.35:
            prompt = shared[: rng.randint(0, 40)] + [rng.randrange(3, 49000) for _ in range(rng.randint(1, 30))]
            params = SamplingParams(temperature=rng.choice([0, 1.0]), max_tokens=rng.randint(1, 40),
                                    n=rng.choice([1, 1, 2]), seed=rng.randint(0, 9), ignore_eos=rng.random() < 0.5)
            try:
                engine.add_request(f"r{submitted}", prompt, params)
            except ValueError:
                assert len(prompt) + params.max_tokens > engine.max_model_len
            submitted += 1
        if engine.requests and rng.random() < 0.15:
            out = engine.abort(rng.choice(list(engine.requests)))
            finish_reasons[out.request_id] = "abort"
            preemptions += out.metrics.num_preemptions
            assert out.finished and all(c.finish_reason in ("abort", "stop", "length") for c in out.outputs)
        for out in engine.step():
            if out.finished:
                finish_reasons[out.request_id] = out.outputs[0].finish_reason
                preemptions += out.metrics.num_preemptions
        engine.check_invariants()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finish_reasons[out.request_id] = out.outputs[0].finish_reason
                preemptions += out.metrics.num_preemptions
        engine.check_invariants()
    print(f"seed {seed}: {submitted} submitted, {preemptions} preemptions")
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks  # every block free (some still findable in the prefix cache)
    assert set(finish_reasons.values()) <= {"stop", "length", "abort"}


def test_aborting_mid_generation_frees_the_blocks_at_once(tiny_chat_model):
    engine = make_engine(tiny_chat_model, kv_cache_memory="8MiB")
    engine.add_request("a", list(range(100, 140)), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    held = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    assert held > 0
    out = engine.abort("a")
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) == 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished() and engine.abort("a") is None


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "the prompt is empty"),
    ([5, 10**6], SamplingParams(), "outside the vocabulary"),
    (list(range(3, 2000)), SamplingParams(max_tokens=100), "exceeds max_model_len"),
])
def test_requests_that_cannot_be_served_are_refused_with_what_to_change(tiny_chat_model, prompt, params, message):
    engine = make_engine(tiny_chat_model, kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match=message):
        engine.add_request("x", prompt, params)
    assert not engine.has_unfinished()


def test_a_pool_too_small_for_a_prompt_says_raise_kv_cache_memory(tiny_chat_model):
    engine = make_engine(tiny_chat_model, kv_cache_memory=64 * 2**10)  # a few blocks
    assert engine.max_model_len == engine.num_kv_tokens
    with pytest.raises(ValueError, match="raise --kv-cache-memory"):
        engine.add_request("x", list(range(3, 3 + engine.num_kv_tokens)), SamplingParams(max_tokens=1))


def test_duplicate_request_ids_are_refused(tiny_chat_model):
    engine = make_engine(tiny_chat_model, kv_cache_memory="8MiB")
    engine.add_request("same", [5, 6, 7])
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("same", [5, 6, 7])


def test_stop_token_ids_and_max_tokens_set_the_finish_reason(tiny_chat_model):
    engine = make_engine(tiny_chat_model, kv_cache_memory="8MiB")
    engine.add_request("free", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    free = None
    while engine.has_unfinished():
        free = next((o for o in engine.step() if o.finished), free)
    tokens = free.outputs[0].token_ids
    assert free.outputs[0].finish_reason == "length" and len(tokens) == 6
    engine.add_request("stopped", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                           stop_token_ids=[tokens[2]]))
    while engine.has_unfinished():
        stopped = next((o for o in engine.step() if o.finished), None)
    first = tokens.index(tokens[2])
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].token_ids == tokens[: first + 1]


def test_kv_pool_size_follows_the_memory_budget(tiny_chat_model):
    small = make_engine(tiny_chat_model, kv_cache_memory="1MiB")
    large = make_engine(tiny_chat_model, kv_cache_memory="4MiB")
    assert large.num_kv_tokens == 4 * small.num_kv_tokens
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head dim 16, fp32
    assert small.num_kv_tokens == 2**20 // (per_token * 16) * 16


def test_the_engine_gives_the_same_tokens_on_the_triton_kernel(tiny_chat_model, monkeypatch):
    """Ragged batches (chunked prefill beside decodes, greedy and seeded sampling) with attention
    forced onto the Triton kernels (the interpreter on a CPU) emit what the reference emits."""
    pytest.importorskip("triton")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49000) for _ in range(length)] for length in (5, 37, 60, 18)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)]

    def generate(backend: str) -> list[list[int]]:
        monkeypatch.setenv("SPECSERVE_ATTENTION", backend)
        engine = make_engine(tiny_chat_model, max_num_batched_tokens=24, max_num_seqs=4, kv_cache_memory="4MiB")
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params[i % 2])
        done = {}
        while engine.has_unfinished():
            done.update({out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished})
        return [list(done[str(i)]) for i in range(len(prompts))]

    assert generate("triton") == generate("reference")


def test_what_the_engine_loaded_is_kept_out_of_the_garbage_collectors_walks(tiny_chat_model):
    """A full collection would walk the model's and tokenizer's objects in the middle of a step."""
    gc.unfreeze()
    engine = make_engine(tiny_chat_model)
    assert not any(o is engine.model for o in gc.get_objects())  # frozen: no generation holds it


# -- one request's failure is its own ----------------------------------------------------------------


def run_all(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Every request to its end: request id -> its final output."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_a_drafter_that_raises_costs_its_sequences_that_step_only(tiny_chat_model, monkeypatch):
    prompts = {f"r{i}": ([5, 6, 7, 5, 6, 7, 5, 6] * (i + 1), SamplingParams(temperature=0, max_tokens=24,
                                                                            ignore_eos=True)) for i in range(4)}
    expected = run_all(make_engine(tiny_chat_model, draft="none"), prompts)
    engine = make_engine(tiny_chat_model, draft="ngram", speculation="fixed")
    real, calls = engine.drafter.propose, []

    def flaky(requests):
        calls.append(len(requests))
        if len(calls) % 2:
            raise RuntimeError("the drafter tripped")
        return real(requests)

    monkeypatch.setattr(engine.drafter, "propose", flaky)
    finals = run_all(engine, prompts)
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == \
           {rid: out.outputs[0].token_ids for rid, out in expected.items()}
    assert engine.metrics.drafter_errors == (len(calls) + 1) // 2 > 0
    assert engine.metrics.spec.accepted_tokens > 0  # the steps between still speculated
    engine.check_invariants()


def test_a_request_whose_sampling_raises_fails_alone(tiny_chat_model, failing_sampling):
    sampled = SamplingParams(temperature=0.9, max_tokens=12, seed=1, n=2, ignore_eos=True)
    requests = {"greedy": ([3, 4, 5], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
                "seeded": ([8, 9], sampled)}
    expected = run_all(make_engine(tiny_chat_model), requests)
    failing_sampling(13, "sampling broke")
    engine = make_engine(tiny_chat_model)
    doomed = SamplingParams(temperature=0.9, max_tokens=12, seed=13, n=2, ignore_eos=True)
    finals = run_all(engine, {**requests, "doomed": ([6, 7], doomed)})
    assert "sampling broke" in finals["doomed"].error
    assert [c.finish_reason for c in finals["doomed"].outputs] == ["error", "error"]
    for rid in requests:
        assert finals[rid].error is None
        assert [c.token_ids for c in finals[rid].outputs] == [c.token_ids for c in expected[rid].outputs]
    assert engine.metrics.failed_requests == 1
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_request_named_drafters_are_cached_by_normalised_spec_and_bounded(tiny_chat_model):
    from specserve.engine import MAX_CACHED_DRAFTERS

    engine = make_engine(tiny_chat_model, draft="ngram")
    for spelling in ("ngram", " NGram ", "ngram  "):
        engine.add_request(spelling, [3, 4], SamplingParams(max_tokens=1, speculation={"drafter": spelling}))
    assert list(engine._drafters) == ["ngram"]
    for parts in range(1, MAX_CACHED_DRAFTERS + 10):  # distinct combinations, as a client could send
        spec = "+".join(["ngram"] * parts)
        engine.add_request(f"combo{parts}", [3, 4], SamplingParams(max_tokens=1, speculation={"drafter": spec}))
    assert len(engine._drafters) == MAX_CACHED_DRAFTERS and "ngram" in engine._drafters
    while engine.has_unfinished():
        engine.step()
    engine.check_invariants()
