"""`specserve train-drafter` really learns, and writes a head the engine drafts with losslessly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from drafters.heads import HeadConfig
from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.sampling import SamplingParams
from specserve.training import data
from specserve.training.budget import BudgetSpent
from specserve.training.data import Example, GenerationSettings, extract_saved, generate, load_instructions
from specserve.training.heads import TrainableHead
from specserve.training.train import TrainSettings, train_drafter

TOPICS = ["the sea", "a robot", "my garden", "trains", "the moon", "a detective", "pizza", "winter", "music",
          "a castle", "rain", "a library"]


@pytest.fixture(scope="module")
def peaked_chat_model(smollm2_path, tmp_path_factory, make_tiny_checkpoint):
    """A tiny random Llama with SmolLM2's tokenizer whose next-token distributions are peaked
    (large initial weights): its answers follow from their context, so a head can learn them."""
    import shutil

    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("peaked-chat"), vocab_size=49152, eos_token_id=2,
                                     bos_token_id=1, max_position_embeddings=2048, initializer_range=1.0,
                                     num_hidden_layers=3)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_path / name).exists():
            shutil.copy(smollm2_path / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def instructions(tmp_path_factory):
    """A GPTeacher-style file (instruction + optional input) of 48 made-up requests."""
    records = [{"instruction": f"Write two sentences about {topic}.", "input": "" if i % 2 else f"Style {i}",
                "output": "unused"} for i, topic in enumerate(TOPICS * 4)]
    path = tmp_path_factory.mktemp("data") / "instructions.json"
    path.write_text(json.dumps(records))
    return path


def test_instructions_join_the_input_and_shuffle_by_seed(instructions):
    turns = load_instructions([instructions], 48, seed=0)
    assert len(turns) == 48 and turns != load_instructions([instructions], 48, seed=1)
    assert any(t.endswith("\n\nStyle 0") for t in turns)
    assert sorted(turns) == sorted(load_instructions([instructions], 48, seed=1))


def test_answers_resume_from_their_cache_and_skip_prompts_too_long(peaked_chat_model, tmp_path):
    engine = LLMEngine(peaked_chat_model, "float32", EngineConfig(kv_cache_memory="16MiB"))
    texts = [f"Write two sentences about {topic}." for topic in TOPICS[:5]] + ["Tell me " + "a lot " * 60]
    settings = GenerationSettings(samples=6, max_new_tokens=6, max_prompt_tokens=40)
    cache = tmp_path / "answers.jsonl"
    first = generate(engine, texts, settings, cache, max_in_flight=2, progress=False)
    assert len(first) == 5 and all(len(e.output_ids) == 6 or e.output_ids[-1] == 2 for e in first)
    lines = cache.read_text().splitlines()
    assert len(lines) == 6 and {json.loads(line)["index"] for line in lines} == set(range(6))

    cache.write_text("\n".join(lines[:3]) + "\n")  # interrupted after three answers
    again = generate(engine, texts, settings, cache, max_in_flight=2, progress=False)
    assert again == first and len(cache.read_text().splitlines()) == 6


@pytest.mark.parametrize("kind", ["feature", "early-exit"])
def test_training_lowers_validation_loss_and_raises_agreement(peaked_chat_model, instructions, tmp_path, kind):
    out = tmp_path / "head"
    config = train_drafter(
        str(peaked_chat_model), out,
        TrainSettings(kind=kind, layer=1, epochs=8, lr=3e-3, batch_tokens=512, draft_vocab=512, validation=0.25),
        GenerationSettings(samples=48, max_new_tokens=32), data=[instructions], dtype="float32",
        work_dir=tmp_path / "work", progress=False)
    epochs = config.training["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(9))
    assert epochs[-1]["val_loss"] < 0.9 * epochs[0]["val_loss"]
    assert epochs[-1]["val_agreement"] > epochs[0]["val_agreement"] + 0.05
    saved = HeadConfig.load(out)
    assert saved.kind == kind and saved.layer == (1 if kind == "early-exit" else 3) and saved.vocab_size >= 512

    # The head drafts for the engine, and greedy output stays the target's own.
    prompts = [[1, 504, 3115, 28, 253, 1935, 30]] * 2 + [[1, 9690, 314, 253, 1789, 28]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(draft: str) -> list[list[int]]:
        engine = LLMEngine(peaked_chat_model, "float32", EngineConfig(draft=draft, speculation="fixed",
                                                                   max_tree_tokens=6, kv_cache_memory="16MiB"))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy)
        done = {}
        while engine.has_unfinished():
            for o in engine.step():
                engine.check_invariants()
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return [done[str(i)] for i in range(len(prompts))], engine

    plain, _ = run("none")
    speculative, engine = run(f"{kind}:{out}")
    assert speculative == plain
    assert engine.metrics.spec.drafted_tokens > 0

    # The saved head loads back into trainable form unchanged (to score it, or train it on).
    saved_tensors = load_file(out / "head.safetensors")
    again = TrainableHead.from_tensors(engine.model, kind, saved.layer, saved_tensors).tensors()
    assert again.keys() == saved_tensors.keys()
    assert all(torch.equal(again[name], saved_tensors[name]) for name in again)


def test_a_head_learns_from_the_target_as_it_is_served_quantized_weights_included(peaked_chat_model, instructions,
                                                                                 tmp_path):
    """Quantized weights (as a GGUF serves on a CPU by default): the answers and states are that
    target's, the early-exit head starts from its layer's exact values, and it drafts for an
    engine serving the same weights with greedy output unchanged."""
    out, work = tmp_path / "head", tmp_path / "work"
    generation = GenerationSettings(samples=16, max_new_tokens=16)
    settings = TrainSettings(kind="early-exit", layer=1, epochs=1, batch_tokens=512, draft_vocab=512)
    config = train_drafter(str(peaked_chat_model), out, settings, generation, data=[instructions], work_dir=work,
                           progress=False, quantization="int8")
    assert config.training["weights"] == "requantized blocks int8"

    engine = LLMEngine(peaked_chat_model, None, EngineConfig(quantization="int8", speculation="off"))
    layer = engine.model.layers[1]
    fresh = TrainableHead(engine.model, "early-exit", 1, torch.arange(512)).layer
    assert torch.equal(fresh.q_proj.weight, layer.self_attn.qkv_proj.dense_blocks()[0])
    assert torch.equal(fresh.down_proj.weight, layer.mlp.down_proj.dense_blocks()[0])
    # the answers cached are the quantized target's own greedy ones
    cached = [json.loads(line) for line in next(work.glob("answers-*.jsonl")).read_text().splitlines()]
    first = cached[0]
    greedy = SamplingParams(temperature=0, max_tokens=16)
    engine.add_request("0", first["prompt_ids"], greedy)
    while engine.has_unfinished():
        done = [o for o in engine.step() if o.finished]
    assert list(done[0].outputs[0].token_ids) == first["output_ids"]

    prompts = [[1, 504, 3115, 28, 253, 1935, 30], [1, 9690, 314, 253, 1789, 28]]
    outputs = {}
    for draft in ("none", f"early-exit:{out}"):
        served = LLMEngine(peaked_chat_model, None, EngineConfig(quantization="int8", draft=draft, speculation="fixed",
                                                                 max_tree_tokens=6, kv_cache_memory="16MiB"))
        for i, p in enumerate(prompts):
            served.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        finished = {}
        while served.has_unfinished():
            finished.update((o.request_id, list(o.outputs[0].token_ids)) for o in served.step() if o.finished)
        outputs[draft] = finished
        assert served.block_manager.num_free_blocks == served.block_manager.num_blocks
    assert outputs["none"] == outputs[f"early-exit:{out}"]
    assert served.metrics.spec.drafted_tokens > 0


def test_a_conversation_is_answered_as_its_last_user_turn_in_context(peaked_chat_model, tmp_path):
    engine = LLMEngine(peaked_chat_model, "float32", EngineConfig(kv_cache_memory="16MiB"))
    conversation = [{"role": "user", "content": "Write two sentences about the sea."},
                    {"role": "assistant", "content": "The sea is wide. It is blue."},
                    {"role": "user", "content": "Now make them rhyme."}]
    settings = GenerationSettings(samples=2, max_new_tokens=6)
    examples = generate(engine, ["Write two sentences about trains.", conversation], settings,
                        tmp_path / "answers.jsonl", progress=False)
    assert [e.prompt_ids for e in examples] == [engine.encode("Write two sentences about trains.", chat=True),
                                                engine.encode_chat(conversation)]
    assert all(e.output_ids for e in examples)


def test_follow_ups_without_self_written_first_turns_are_refused(peaked_chat_model, instructions, tmp_path):
    with pytest.raises(ValueError, match="give --self-instruct N too"):
        train_drafter(str(peaked_chat_model), tmp_path / "head", TrainSettings(epochs=1),
                      GenerationSettings(samples=4, max_new_tokens=4, follow_ups=2), data=[instructions],
                      dtype="float32", work_dir=tmp_path / "work", progress=False)


def test_answers_cut_by_the_budget_keep_what_finished_and_resume(peaked_chat_model, tmp_path, stops_after):
    engine = LLMEngine(peaked_chat_model, "float32", EngineConfig(kv_cache_memory="16MiB"))
    texts = [f"Write two sentences about {topic}." for topic in TOPICS[:6]]
    settings = GenerationSettings(samples=6, max_new_tokens=8)
    whole = generate(engine, texts, settings, tmp_path / "whole.jsonl", max_in_flight=2, progress=False)
    cache = tmp_path / "answers.jsonl"
    saved = []
    for _ in range(10):
        try:
            resumed = generate(engine, texts, settings, cache, max_in_flight=2, progress=False,
                               budget=stops_after(12))
            break
        except BudgetSpent as stop:
            assert stop.stage == "answers"
            assert not engine.has_unfinished()  # the answers cut short were aborted, their blocks freed
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
            saved.append(len(cache.read_text().splitlines()))
    assert saved and saved == sorted(set(saved)) and saved[0] > 0  # every run kept more
    assert resumed == whole


def test_a_budget_shorter_than_one_unit_of_work_still_moves_every_run_forward(peaked_chat_model, tmp_path,
                                                                              stops_after):
    """Each stage checks only once it has saved something in this run: no run ends where it began."""
    engine = LLMEngine(peaked_chat_model, "float32", EngineConfig(kv_cache_memory="16MiB"))
    texts = [f"Write two sentences about {topic}." for topic in TOPICS[:4]]
    cache = tmp_path / "answers.jsonl"
    settings = GenerationSettings(samples=4, max_new_tokens=8)
    for run in range(1, 10):
        try:
            generate(engine, texts, settings, cache, max_in_flight=4, progress=False, budget=stops_after(0))
            break
        except BudgetSpent:
            assert len(cache.read_text().splitlines()) >= run  # spent from the start, yet one more answer
    assert len(cache.read_text().splitlines()) == 4


def test_states_are_saved_in_shards_and_a_cut_run_resumes_to_the_same_states(peaked_chat_model, tmp_path,
                                                                             stops_after):
    model = LLMEngine(peaked_chat_model, "float32", EngineConfig(kv_cache_memory="16MiB")).model
    examples = [Example([1, 504, 3115 + i], [28 + i] * (i + 2)) for i in range(7)]
    whole = extract_saved(model, examples, [1, 3], tmp_path / "whole.safetensors", shard=2, progress=False)
    path = tmp_path / "states.safetensors"
    with pytest.raises(BudgetSpent, match="'states' \\(4 of 7"):  # a run checks once it has moved forward
        extract_saved(model, examples, [1, 3], path, stops_after(1), shard=2, progress=False)
    shards = path.with_name(path.name + ".shards")
    assert len(list(shards.iterdir())) == 2 and not path.exists()
    resumed = extract_saved(model, examples, [1, 3], path, stops_after(2), shard=2, progress=False)
    assert path.exists() and not shards.exists()
    assert torch.equal(resumed.tokens, whole.tokens) and torch.equal(resumed.offsets, whole.offsets)
    assert torch.equal(resumed.prompt_lens, whole.prompt_lens)
    assert all(torch.equal(resumed.hidden[k], whole.hidden[k]) for k in (1, 3))
    assert whole.offsets.tolist()[-1] == sum(len(e.token_ids) for e in examples) == len(whole.hidden[3])


def test_a_run_cut_by_its_budget_resumes_to_the_head_of_an_uninterrupted_run(peaked_chat_model, instructions,
                                                                            tmp_path, monkeypatch, stops_after):
    monkeypatch.setattr(data, "STATE_SHARD_EXAMPLES", 8)
    settings = TrainSettings(kind="feature", epochs=3, lr=3e-3, batch_tokens=256, draft_vocab=512, validation=0.25)
    work = tmp_path / "work"

    def train(out, budget=None):
        return train_drafter(str(peaked_chat_model), out, settings, GenerationSettings(samples=24, max_new_tokens=16),
                             data=[instructions], dtype="float32", work_dir=work, progress=False, budget=budget)

    whole = train(tmp_path / "whole")
    for states in work.glob("states-*"):
        states.unlink()  # the answers stay: the states and the training are cut and resumed
    stages = []
    for _ in range(60):
        try:
            cut = train(tmp_path / "cut", stops_after(1))
            break
        except BudgetSpent as stop:
            stages.append(stop.stage)
            assert list(work.glob("checkpoint-*")) or stop.stage == "states"
    assert stages.count("states") >= 1 and stages.count("train") >= 3

    def without_times(config):
        return [{k: v for k, v in epoch.items() if k != "seconds"} for epoch in config.training["epochs"]]

    assert without_times(cut) == without_times(whole)
    ours, theirs = load_file(tmp_path / "cut" / "head.safetensors"), load_file(tmp_path / "whole" / "head.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not list(work.glob("checkpoint-*"))  # the head is saved: nothing left to resume


def test_train_drafter_out_of_budget_exits_75_saying_to_run_it_again(monkeypatch, capsys):
    from specserve import cli
    from specserve.training import train

    budgets = []

    def stopped(*args, budget, **kwargs):
        budgets.append(budget)
        raise BudgetSpent("answers", "3 of 10 answered")

    monkeypatch.setattr(train, "train_drafter", stopped)
    assert cli.main(["train-drafter", "--out", "head", "--budget-minutes", "1.5"]) == 75
    err = capsys.readouterr().err
    assert "'answers' (3 of 10 answered)" in err and "run the same command again" in err
    assert budgets[0].seconds == 90
