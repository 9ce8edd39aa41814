"""The offline API on the real SmolLM2, as scripts use it: `LLM(...).generate/chat` with
`SamplingParams`, results in `.outputs[i].text/.token_ids/.finish_reason`."""

from __future__ import annotations

import pytest

import specserve
from specserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three colours of the rainbow are", "1, 2, 3,"]


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(target=str(smollm2_path), dtype="float32", quantization="none", kv_cache_memory="128MiB")


def test_generate_returns_one_finished_result_per_prompt_in_order(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    for out in outs:
        (completion,) = out.outputs
        assert out.finished and completion.finish_reason in ("stop", "length")
        assert 0 < len(completion.token_ids) <= 8
        assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    alone = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_seeded_samples_do_not_depend_on_the_rest_of_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=n, seed=None) for n in (3, 20, 9)]
    mixed = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[3]], [others[0], seeded, others[1], others[2]],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    again = llm.generate([PROMPTS[0]] * 3, seeded, use_tqdm=False)
    assert all(o.outputs[0].token_ids == alone for o in again)


def test_n_samples_come_back_together_and_are_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    first = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    second = llm.generate([PROMPTS[3], PROMPTS[0]], params, use_tqdm=False)[1]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]


def test_stop_strings_cut_the_text_before_them(llm):
    free = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    text = free.outputs[0].text
    assert " 6" in text, text
    stopped = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=24, stop=[" 6", "zzz"]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(" 6")]


def test_logprobs_are_the_models_own(llm, smollm2_path):
    import torch

    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    for entry, token in zip(completion.logprobs, completion.token_ids, strict=True):
        assert entry.token_id == token and len(entry.top_logprobs) == 3
        assert max(entry.top_logprobs.values()) == pytest.approx(entry.logprob, abs=1e-5)  # greedy picks the top
    assert completion.cumulative_logprob == pytest.approx(sum(e.logprob for e in completion.logprobs))
    # the first token's logprob equals a direct forward through transformers
    from specserve.models.loader import load_transformers

    hf = load_transformers(smollm2_path, torch.float32)
    logits = hf(torch.tensor([out.prompt_token_ids])).logits[0, -1]
    expected = torch.log_softmax(logits, -1)[completion.token_ids[0]].item()
    assert completion.logprobs[0].logprob == pytest.approx(expected, abs=1e-4)


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=6),
                   use_tqdm=False)[0]
    expected = llm.engine.encode_chat([{"role": "user", "content": "Say hello."}])
    assert out.prompt_token_ids == expected and out.outputs[0].text
    two = llm.chat([[{"role": "user", "content": "Say hello."}], [{"role": "user", "content": "Say bye."}]],
                   SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_top_level_exports():
    assert specserve.LLM is LLM and specserve.SamplingParams is SamplingParams


def test_a_bad_draft_spec_is_refused_before_loading(smollm2_path):
    with pytest.raises(ValueError, match="'none' cannot be combined"):
        LLM(target=str(smollm2_path), draft="ngram+none")


def test_mismatched_sampling_params_are_refused(llm):
    with pytest.raises(ValueError, match="give one, or one each"):
        llm.generate(PROMPTS, [SamplingParams()] * 2, use_tqdm=False)
    assert not llm.engine.has_unfinished()
