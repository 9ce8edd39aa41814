"""The engine on a GPU generates what it generates on the CPU: greedy, fp32, the same saved weights
(dummy weights are drawn by each device's own generator, so they would differ)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.detokenizer import synthetic_tokenizer
from specserve.llm import LLM
from specserve.models.config import ModelConfig
from specserve.sampling import SamplingParams, SpeculationParams

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [3, 4, 5], list(range(20, 60))]


def greedy(path: Path, device: str, draft: str, graphs: bool, kv_cache_dtype: str = "auto") -> list[list[int]]:
    speculation = {"speculation": "fixed", "max_tree_tokens": 4} if draft != "none" else {}
    llm = LLM(str(path), draft=draft, dtype="float32", device=device, max_num_seqs=4, max_num_batched_tokens=64,
              kv_cache_memory="4MiB", kv_cache_dtype=kv_cache_dtype, enforce_eager=not graphs, **speculation)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.cuda
@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_the_engine_on_a_gpu_generates_the_cpus_greedy_tokens(tiny_checkpoint, draft):
    path = tiny_checkpoint("llama", vocab_size=300)
    synthetic_tokenizer(ModelConfig.from_dir(path)).save_pretrained(path)
    on_cpu = greedy(path, "cpu", draft, graphs=False)
    assert greedy(path, "cuda", draft, graphs=False) == on_cpu
    assert greedy(path, "cuda", draft, graphs=True) == on_cpu


@pytest.mark.cuda
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_speculation_over_a_quantized_cache_on_a_gpu_generates_what_decoding_over_it_does(tiny_checkpoint,
                                                                                          kv_cache_dtype):
    """Lossless against the served model: the tree's K/V are quantized as they are written, so
    a verified tree reads what decoding the same tokens one by one would have read."""
    path = tiny_checkpoint("llama", vocab_size=300)
    synthetic_tokenizer(ModelConfig.from_dir(path)).save_pretrained(path)
    decoded = greedy(path, "cuda", "none", graphs=False, kv_cache_dtype=kv_cache_dtype)
    assert greedy(path, "cuda", "ngram", graphs=False, kv_cache_dtype=kv_cache_dtype) == decoded
    assert greedy(path, "cuda", "ngram", graphs=True, kv_cache_dtype=kv_cache_dtype) == decoded


@pytest.mark.cuda
def test_trees_verified_over_a_cache_of_more_than_2_31_elements_keep_the_greedy_output(dummy_model):
    """A served cache holds all layers in one tensor, past 2**31 elements: the accepted nodes of
    trees compacted in its last layers land where they belong (20 GiB of GPU memory). In fp32: in
    bf16, verification's wider matrix products round differently from decodes', which can flip a
    near-tie of a random model's logits."""
    directory = dummy_model(num_hidden_layers=8, num_key_value_heads=4)
    llm = LLM(str(directory), draft="replay:0.8", load_format="dummy", device="cuda", dtype="float32",
              kv_cache_memory="20GiB", speculation="fixed", max_tree_tokens=8)
    assert llm.engine.runner.kv_cache.k.numel() > 2**31
    prompts = [[3 + i, 40 + 7 * i, 90 + i] for i in range(8)]
    tree = SpeculationParams(drafter="replay:0.8", tree="tree", top_k=4)
    greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, speculation=tree)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]  # records them
    replayed = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert replayed == plain and llm.engine.metrics.spec.accepted_tokens > 100
