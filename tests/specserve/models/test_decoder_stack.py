"""The decoder layers in one C++ call (`native.decoder_stack`) compute exactly what the modules
compute one by one: the same logits, hidden states and K/V, bit for bit."""

from __future__ import annotations

import pytest
import torch

from specserve.kv_cache import KVCache
from specserve.model_runner import ModelRunner, TreeRequest
from specserve.models.loader import load_model
from specserve.tree import TokenTree

BRANCHING = (-1, 0, 0, 1, 1, 2, 3, 3)


def steps(model) -> list[torch.Tensor]:
    """A prompt with hidden states, a branching tree batched with a second prompt, a decode and
    an early exit: every output, then the caches."""
    runner = ModelRunner(model, KVCache.for_model(model.config, 12, 4, torch.float32))
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 211, (13,), generator=gen).tolist()
    tree = TokenTree(tuple(torch.randint(0, 211, (len(BRANCHING),), generator=gen).tolist()), BRANCHING)
    last = model.config.num_layers
    first = runner.forward([TreeRequest(TokenTree.chain(prompt), 0, [0, 1, 2, 3])], hidden_at=(0, 1, last))
    batched = runner.forward([TreeRequest(tree, 13, [0, 1, 2, 3, 4, 5]),
                              TreeRequest(TokenTree.chain(prompt[:6]), 0, [9, 10])], hidden_at=(1,))
    decode = runner.forward([TreeRequest(TokenTree.single(7), 21, [0, 1, 2, 3, 4, 5])])
    early = runner.forward([TreeRequest(TokenTree.single(8), 22, [0, 1, 2, 3, 4, 5])], num_layers=1)
    return [first.logits, *first.hidden.values(), batched.logits, *batched.hidden.values(), decode.logits,
            early.logits, runner.kv_cache.k, runner.kv_cache.v]


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_the_stack_computes_the_bits_of_the_layers_one_by_one(tiny_checkpoint, monkeypatch, model_type, quantization):
    model = load_model(tiny_checkpoint(model_type, seed=2, tie_word_embeddings=False), quantization=quantization)
    with torch.inference_mode():
        stacked = steps(model)
        assert model._stack is not None and model._stack[1] is not None  # the stack ran
        monkeypatch.setenv("SPECSERVE_DECODER_STACK", "0")
        one_by_one = steps(model)
    for got, expected in zip(stacked, one_by_one, strict=True):
        assert torch.equal(got, expected)


def test_new_weights_build_a_new_stack(tiny_checkpoint, monkeypatch):
    """A stack binds the weights it was built over: when a projection takes new ones, the next
    forward builds another, which computes with the new weights."""
    model = load_model(tiny_checkpoint("llama", seed=2, tie_word_embeddings=False), quantization="int4")
    with torch.inference_mode():
        before = steps(model)
        stack = model._stack[1]
        for layer in model.layers:
            layer.mlp.down_proj.requantize(8)
        after = steps(model)
        assert model._stack[1] is not stack
        monkeypatch.setenv("SPECSERVE_DECODER_STACK", "0")
        one_by_one = steps(model)
    assert not torch.equal(before[0], after[0])
    for got, expected in zip(after, one_by_one, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("case", ["plain fp32", "bf16", "reference attention"])
def test_steps_the_stack_cannot_run_go_module_by_module(tiny_checkpoint, monkeypatch, case):
    path = tiny_checkpoint("llama", seed=2, tie_word_embeddings=False)
    if case == "plain fp32":
        model = load_model(path, torch.float32, quantization="none")
    elif case == "bf16":
        model = load_model(path, torch.bfloat16, quantization="none")
    else:
        monkeypatch.setenv("SPECSERVE_ATTENTION", "reference")
        model = load_model(path, quantization="int4")
    runner = ModelRunner(model, KVCache.for_model(model.config, 4, 4, model.dtype))
    with torch.inference_mode():
        out = runner.forward([TreeRequest(TokenTree.chain([3, 4, 5]), 0, [0, 1])])
    assert out.logits.shape == (3, 211)
    assert model._stack is None or model._stack[1] is None
