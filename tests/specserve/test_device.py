"""The engine on a GPU generates what it generates on the CPU: greedy, fp32, the same saved weights
(dummy weights are drawn by each device's own generator, so they would differ)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.detokenizer import synthetic_tokenizer
from specserve.llm import LLM
from specserve.models.config import ModelConfig
from specserve.sampling import SamplingParams

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [3, 4, 5], list(range(20, 60))]


def greedy(path: Path, device: str, draft: str, graphs: bool) -> list[list[int]]:
    speculation = {"speculation": "fixed", "max_tree_tokens": 4} if draft != "none" else {}
    llm = LLM(str(path), draft=draft, dtype="float32", device=device, max_num_seqs=4, max_num_batched_tokens=64,
              kv_cache_memory="4MiB", enforce_eager=not graphs, **speculation)
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
