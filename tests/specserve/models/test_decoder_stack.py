"""The decoder layers in one C++ call (`native.decoder_stack`) compute exactly what the modules
compute one by one: the same logits, hidden states and K/V, bit for bit; so does a whole step in
it, from token ids to logits."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from specserve.kv_cache import KVCache
from specserve.model_runner import ModelRunner, TreeRequest
from specserve.models.gguf import BlockWeight, decode_blocks
from specserve.models.linear import QuantizedEmbedding, weights_changed
from specserve.models.llama import _swiglu_call, bind_embedding
from specserve.models.loader import load_model
from specserve.tree import TokenTree
from tests.specserve.models.test_gguf import LAYOUTS, random_blocks

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
    # the final-normed states alone (what a feature head reads): a whole step in the stack too
    final = runner.forward([TreeRequest(tree, 23, [0, 1, 2, 3, 4, 5, 6, 7], (0, 2, 5))], hidden_at=(last,))
    return [first.logits, *first.hidden.values(), batched.logits, *batched.hidden.values(), decode.logits,
            early.logits, final.logits, final.hidden[last], runner.kv_cache.k, runner.kv_cache.v]


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


def test_the_stack_runs_the_gate_up_projection_and_swiglu_as_one_op_over_tiles(tiny_checkpoint):
    # (what the test above then holds to the modules' bits: their two ops)
    model = load_model(tiny_checkpoint("llama", seed=2, tie_word_embeddings=False), quantization="int4")
    gate_up = model.layers[0].mlp.gate_up_proj
    if gate_up.quantized[0].tiles() is None:
        pytest.skip(f"no tiles on this CPU ({native.isa()})")
    assert _swiglu_call(gate_up)[0] == "specserve_cpu::tiled_swiglu"


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


def scored_steps(model) -> list[torch.Tensor]:
    """Steps whose logits the stack computes from the token ids: a prompt's last row, a
    branching tree's chosen nodes beside a second prompt, decodes of two requests, then the caches."""
    runner = ModelRunner(model, KVCache.for_model(model.config, 12, 4, torch.float32))
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, 211, (13,), generator=gen).tolist()
    tree = TokenTree(tuple(torch.randint(0, 211, (len(BRANCHING),), generator=gen).tolist()), BRANCHING)
    first = runner.forward([TreeRequest(TokenTree.chain(prompt), 0, [0, 1, 2, 3], logits="last")])
    batched = runner.forward([TreeRequest(tree, 13, [0, 1, 2, 3, 4, 5], logits=[0, 3, 6]),
                              TreeRequest(TokenTree.chain(prompt[:6]), 0, [9, 10])])
    decodes = runner.forward([TreeRequest(TokenTree.single(7), 21, [0, 1, 2, 3, 4, 5]),
                              TreeRequest(TokenTree.single(8), 6, [9, 10])])
    return [first.logits, batched.logits, decodes.logits, runner.kv_cache.k, runner.kv_cache.v]


@pytest.mark.parametrize("embedding", ["table", "int8 blocks", "int4 blocks"])
def test_a_step_from_token_ids_to_logits_in_the_stack_has_the_bits_of_the_modules(tiny_checkpoint, monkeypatch,
                                                                                   embedding):
    """The embedding (a float table, or blocks with a zero point or with 4-bit codes and minimums),
    the layers, the chosen rows' final norm and the LM head, all in the stack."""
    model = load_model(tiny_checkpoint("qwen2", seed=4, tie_word_embeddings=False), quantization="int4")
    if embedding != "table":
        bits = 8 if embedding == "int8 blocks" else 4
        model.embed_tokens = QuantizedEmbedding(BlockWeight.quantize(model.embed_tokens.weight, bits), torch.float32)
        weights_changed()
    with torch.inference_mode():
        stacked = scored_steps(model)
        assert model._stack is not None and model._stack[2]  # the stack scored the steps
        monkeypatch.setenv("SPECSERVE_DECODER_STACK", "layers")
        layers_only = scored_steps(model)
        monkeypatch.setenv("SPECSERVE_DECODER_STACK", "0")
        one_by_one = scored_steps(model)
    assert [t.shape[0] for t in stacked[:3]] == [1, 9, 2]
    for got, layers, expected in zip(stacked, layers_only, one_by_one, strict=True):
        assert torch.equal(got, expected) and torch.equal(layers, expected)


@pytest.mark.parametrize("kind", [*sorted(LAYOUTS), "int4", "int8"])
def test_the_stack_embeds_every_format_as_the_embedding_module_does(kind):
    """Each GGUF format (random blocks: any codes, scales of both signs) and our requantized ones."""
    rows, hidden = 37, 512
    if kind in LAYOUTS:
        weight = decode_blocks(random_blocks(kind, rows, hidden, seed=11), kind, rows)
    else:
        weight = BlockWeight.quantize(torch.randn(rows, hidden, generator=torch.Generator().manual_seed(3)),
                                      int(kind.removeprefix("int")))
    module = QuantizedEmbedding(weight, torch.float32)
    stack = native.decoder_stack(1, 4, 2, 16, 1e-6)
    assert bind_embedding(stack, module)
    ids = torch.tensor([36, 0, 5, 5, 17])
    assert torch.equal(stack.embed(ids), module(ids))


def test_a_token_outside_the_vocabulary_is_refused_with_its_id(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama", seed=2, tie_word_embeddings=False), quantization="int4")
    runner = ModelRunner(model, KVCache.for_model(model.config, 4, 4, model.dtype))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="token id 211 outside the vocabulary of 211"):
        runner.forward([TreeRequest(TokenTree.chain([3, 211]), 0, [0, 1])])
