"""The model as served is the file's model: greedy generation in fp32 from the GGUF's exact
dequantized weights equals transformers' generation from the same GGUF, token for token, on 30
Spec-Bench questions (five of each of the six main categories, chat-formatted)."""

from __future__ import annotations

import pytest
import torch

from specserve.ablation.config import SPEC_BENCH, spec_bench_prompts
from specserve.closed_loop import run_to_completion
from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.models.loader import load_transformers
from specserve.sampling import SamplingParams

NEW_TOKENS = 48
CATEGORIES = ["translation", "summarization", "qa", "math_reasoning", "rag", "coding"]


@pytest.mark.slow
@pytest.mark.skipif(not SPEC_BENCH.exists(), reason="Spec-Bench questions are not in ../shared/data")
def test_smollm2_fp32_greedy_equals_transformers_on_30_spec_bench_prompts(smollm2_path):
    engine = LLMEngine(smollm2_path, "float32", EngineConfig(quantization="none", speculation="off",
                                                             kv_cache_memory="128MiB"))
    theirs = load_transformers(smollm2_path, torch.float32)
    questions = [p.text for p in spec_bench_prompts(SPEC_BENCH, CATEGORIES, 5)]
    assert len(questions) == 30
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)  # both stop at the model's end of turn
    stops = set(theirs.generation_config.eos_token_id if isinstance(theirs.generation_config.eos_token_id, list)
                else [theirs.generation_config.eos_token_id])

    def until_stop(tokens: list[int]) -> list[int]:
        return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in stops), tokens)
    differing = []
    for i, question in enumerate(questions):
        prompt = engine.encode(question, chat=True)[-400:]
        finished, _, _ = run_to_completion(engine, [prompt], params)  # alone, as transformers runs it
        ours = until_stop(list(finished[0].outputs[0].token_ids))
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            out = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                  do_sample=False, pad_token_id=0)
        if not ours or ours != until_stop(out[0, len(prompt):].tolist()):
            differing.append(i)
    assert not differing, f"greedy output differs from transformers on prompts {differing} of 30"
