"""Prompts the target writes itself (Magpie): the opening of a user turn, filters that keep
Spec-Bench out and duplicates down, and a cache that resumes and extends."""

from __future__ import annotations

import json

import pytest

from specserve.detokenizer import synthetic_tokenizer
from specserve.models.config import ModelConfig
from specserve.training.self_instruct import (
    TEMPERATURES,
    TOPICS,
    Candidate,
    Exchange,
    NearDuplicates,
    _contiguous,
    _verdict,
    cache_name,
    evaluation_grams,
    follow_ups_cache_name,
    plan,
    pre_query,
    write_follow_ups,
    write_prompts,
)

QUESTION = ("Imagine you are a park ranger in a national park and describe the three most important rules "
            "every visitor should follow during the summer season")


@pytest.fixture
def spec_bench(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "roleplay", "turns": [QUESTION, "Shorter now."]}) + "\n")
    return path


def test_a_prompt_sharing_13_words_with_an_evaluation_question_is_dropped(spec_bench):
    forbidden = evaluation_grams(spec_bench)
    copied = "Please help: " + " ".join(QUESTION.split()[5:18]) + ", thanks."  # 13 of its words in a row
    assert _verdict(copied, "stop", forbidden, NearDuplicates()) == "shares 13 words with Spec-Bench"
    twelve = "Please help: " + " ".join(QUESTION.split()[5:17]) + ", thanks."
    assert _verdict(twelve, "stop", forbidden, NearDuplicates()) == ""


def test_unfinished_short_and_near_duplicate_prompts_are_dropped(spec_bench):
    forbidden, kept = evaluation_grams(spec_bench), NearDuplicates()
    first = "Can you write a Python function that reverses a linked list in place?"
    kept.add(first)
    assert _verdict("Can you write a Python function that reverses a linked list?", "stop", forbidden, kept) \
        == "near-duplicate"
    assert _verdict("Translate 'good morning' into French and German, please.", "stop", forbidden, kept) == ""
    assert _verdict("Hello there", "stop", forbidden, kept) == "too short"
    assert _verdict("A long message that never ends its turn and", "length", forbidden, kept) == "unfinished"


def test_without_the_evaluation_questions_it_refuses_and_says_how_to_give_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="--spec-bench"):
        evaluation_grams(tmp_path / "missing.jsonl")


def test_the_opening_is_the_template_up_to_the_users_message_after_a_system_turn_naming_the_topic():
    config = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 300, "hidden_size": 16, "intermediate_size": 32,
                                    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                                    "bos_token_id": 1, "eos_token_id": 2})
    opening = pre_query(synthetic_tokenizer(config), "coding")
    assert opening.startswith("<|system|>") and opening.endswith("<|user|>") and "Python" in opening


def test_a_follow_ups_opening_comes_after_the_exchange_it_continues():
    config = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 300, "hidden_size": 16, "intermediate_size": 32,
                                    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                                    "bos_token_id": 1, "eos_token_id": 2})
    tokenizer = synthetic_tokenizer(config)
    exchange = Exchange("coding", "Write a function that adds two numbers.", "def add(a, b):\n    return a + b")
    opening = pre_query(tokenizer, "coding", exchange.messages())
    first = pre_query(tokenizer, "coding")
    assert opening.startswith(first) and opening.endswith("<|user|>")
    assert opening.index(exchange.prompt) < opening.index(exchange.answer)  # the exchange in order, then the turn


def test_follow_ups_have_a_cache_of_their_own_per_exchanges():
    assert follow_ups_cache_name("a") != follow_ups_cache_name("b") != cache_name("a", 0)
    assert follow_ups_cache_name("a") == follow_ups_cache_name("a")


def test_follow_ups_need_exchanges_to_follow(spec_bench, tmp_path):
    with pytest.raises(ValueError, match="raise --self-instruct"):
        write_follow_ups(None, [], 3, tmp_path / "follow-ups.jsonl", spec_bench)


def test_topics_take_turns_and_each_comes_at_every_temperature():
    seen = [plan(i) for i in range(len(TOPICS) * len(TEMPERATURES))]
    assert len(set(seen)) == len(seen) and [t for t, _ in seen[: len(TOPICS)]] == list(TOPICS)


def test_a_cache_cut_mid_batch_keeps_only_its_unbroken_start():
    written = [Candidate(i, "math", 1.0, f"text {i}") for i in (0, 1, 2, 4)]
    assert [c.index for c in _contiguous(written)] == [0, 1, 2]


@pytest.mark.slow
def test_written_prompts_resume_from_their_cache_and_extend_it(smollm2_path, spec_bench, tmp_path):
    from specserve.config import EngineConfig
    from specserve.engine import LLMEngine

    engine = LLMEngine(smollm2_path, "float32", EngineConfig(speculation="off", kv_cache_memory="256MiB"))  # as served
    cache = tmp_path / "prompts.jsonl"
    first, stats = write_prompts(engine, 6, cache, spec_bench, progress=False)
    assert len(first) == 6 == stats["prompts"] == sum(stats["topics"].values())
    assert stats["candidates"] == 6 + sum(stats["dropped"].values())
    lines = cache.read_text().splitlines()
    cache.write_text("\n".join(lines[: len(lines) // 2]) + "\n")  # interrupted
    again, _ = write_prompts(engine, 6, cache, spec_bench, progress=False)
    assert [c.text for c in again] == [c.text for c in first]  # seeded per candidate: the same prompts
    more, _ = write_prompts(engine, 9, cache, spec_bench, progress=False)
    assert [c.text for c in more[:6]] == [c.text for c in first] and len(more) == 9


def test_a_batch_sends_no_more_candidates_once_enough_are_kept(smollm2_path, spec_bench, tmp_path):
    from specserve.config import EngineConfig
    from specserve.engine import LLMEngine

    engine = LLMEngine(smollm2_path, "float32", EngineConfig(speculation="off", kv_cache_memory="256MiB"))  # as served
    cache = tmp_path / "prompts.jsonl"
    chosen, _ = write_prompts(engine, 3, cache, spec_bench, max_in_flight=2, progress=False)
    # A batch is 16 candidates (at least twice those still needed): once 3 are kept, only the 2 in
    # flight still finish (and are saved).
    assert len(chosen) == 3 and len(cache.read_text().splitlines()) < 16


@pytest.mark.slow
def test_follow_ups_continue_each_exchange_in_turn_and_resume(smollm2_path, spec_bench, tmp_path):
    from specserve.config import EngineConfig
    from specserve.engine import LLMEngine

    engine = LLMEngine(smollm2_path, "float32", EngineConfig(speculation="off", kv_cache_memory="256MiB"))  # as served
    exchanges = [Exchange("math", "What is 12 times 7?", "12 times 7 is 84."),
                 Exchange("writing", "Write a haiku about rain.",
                          "Soft rain on the roof\nwhispers to the sleeping town\npuddles hold the sky")]
    cache = tmp_path / "follow-ups.jsonl"
    first, stats = write_follow_ups(engine, exchanges, 4, cache, spec_bench, progress=False)
    assert len(first) == 4 == stats["prompts"] and all(c.text for c in first)
    written = [json.loads(line) for line in cache.read_text().splitlines()]
    assert all(c["follows"] == c["index"] % 2 for c in written)  # each exchange in turn
    assert {c["topic"] for c in written} == {"math", "writing"}
    assert all(c["temperature"] == TEMPERATURES[c["index"] // 2 % len(TEMPERATURES)] for c in written)
    cache.write_text("\n".join(cache.read_text().splitlines()[:2]) + "\n")  # interrupted after two
    again, _ = write_follow_ups(engine, exchanges, 4, cache, spec_bench, progress=False)
    # The cached two come back as they were; the rest are written anew (sampled in other batches:
    # the same seeds, but fp32 rounding that differs with the batch may part the texts).
    kept_before = [c["text"] for c in written[:2] if not c["why"]]
    assert [c.text for c in again[: len(kept_before)]] == kept_before and len(again) == 4
    resumed = [json.loads(line) for line in cache.read_text().splitlines()]
    assert [c["index"] for c in resumed] == list(range(len(resumed))) and all(c["follows"] == c["index"] % 2
                                                                               for c in resumed)


def test_each_target_and_seed_writes_its_own_prompts_cache():
    names = {cache_name(target, seed) for target in ("a", "b") for seed in (0, 1)}
    assert len(names) == 4 and cache_name("a", 0) == cache_name("a", 0)


def test_a_target_that_writes_nothing_usable_is_stopped_with_a_message(dummy_model, spec_bench, tmp_path,
                                                                         monkeypatch):
    from specserve.config import EngineConfig
    from specserve.engine import LLMEngine
    from specserve.training import self_instruct

    monkeypatch.setattr(self_instruct, "MAX_PROMPT_TOKENS", 24)  # CI time: turns cut short are unfinished too
    monkeypatch.setattr(self_instruct, "MAX_CANDIDATES_PER_PROMPT", 8)

    # random weights over 50,000 tokens: its "user turns" almost never reach their end token
    engine = LLMEngine(dummy_model(vocab_size=50_000), "float32",
                       EngineConfig(load_format="dummy", speculation="off", kv_cache_memory="64MiB"))
    with pytest.raises(RuntimeError, match="does not write usable user turns"):
        write_prompts(engine, 2, tmp_path / "prompts.jsonl", spec_bench, progress=False)


def test_a_budget_that_runs_out_mid_batch_lets_the_candidates_in_flight_finish_and_keeps_them_all(
        dummy_model, spec_bench, tmp_path, monkeypatch):
    from specserve.config import EngineConfig
    from specserve.engine import LLMEngine
    from specserve.training import self_instruct
    from specserve.training.budget import Budget, BudgetSpent

    monkeypatch.setattr(self_instruct, "MAX_PROMPT_TOKENS", 12)  # CI time
    engine = LLMEngine(dummy_model(vocab_size=50_000), "float32",
                       EngineConfig(load_format="dummy", speculation="off", kv_cache_memory="64MiB"))
    cache = tmp_path / "prompts.jsonl"

    class SpentOnceOneIsSaved(Budget):
        @property
        def spent(self) -> bool:
            return cache.exists() and len(cache.read_text().splitlines()) >= 1

    aborted = []
    monkeypatch.setattr(engine, "abort", lambda request_id: aborted.append(request_id))
    # A batch of 16 candidates (all dropped: a random model's turns never end), 4 in flight: the
    # budget runs out when the first is saved; the clients send no more, and those in flight
    # finish and are saved (none aborted).
    with pytest.raises(BudgetSpent, match="'prompts' \\(0 of 2 written\\)"):
        write_prompts(engine, 2, cache, spec_bench, max_in_flight=4, progress=False, budget=SpentOnceOneIsSaved())
    written = [json.loads(line) for line in cache.read_text().splitlines()]
    assert [c["index"] for c in written] == list(range(len(written))) and 4 <= len(written) < 16
    assert not aborted
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
