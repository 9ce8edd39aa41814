"""CUDA graphs: a step that fits a captured size replays its graph and gets the eager forward's
logits, hidden states and K/V; padding writes nothing; what no graph fits runs eagerly.

Without a GPU the graphs "replay" by running the same forward over the same static buffers
(`capture=False`) through the Triton kernels' interpreter: the padding, the buffers and the
choice of graph are what is checked. The `cuda` tests capture for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernels.metadata import PaddedSize
from specserve.cuda_graphs import padded_sizes
from specserve.kv_cache import KVCache
from specserve.model_runner import ModelRunner, TreeRequest
from specserve.models.loader import load_model
from specserve.tree import TokenTree

TINY = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
BLOCKS, BLOCK_SIZE = 24, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    (directory / "config.json").write_text(json.dumps(TINY))
    return load_model(Path(directory), "float32", load_format="dummy", device=DEVICE)


@pytest.fixture(autouse=True)
def triton_attention(monkeypatch):
    monkeypatch.setenv("SPECSERVE_ATTENTION", "triton")  # the kernels a GPU runs (interpreted on a CPU)


def sizes(widths=(1, 4), max_tokens=8) -> list[PaddedSize]:
    return padded_sizes(max_tokens, 4, widths, blocks=BLOCKS, context=200)


def runner_pair(model, hidden_sets=((),), capture=False) -> tuple[ModelRunner, ModelRunner]:
    """A runner with graphs and an eager one, their caches holding the same random K/V."""
    graphed, eager = (ModelRunner(model, KVCache.for_model(model.config, BLOCKS, BLOCK_SIZE, torch.float32, DEVICE))
                      for _ in range(2))
    graphed.capture_graphs(sizes(), hidden_sets, capture=capture)
    gen = torch.Generator().manual_seed(0)
    for cache in (graphed.kv_cache, eager.kv_cache):
        cache.k.copy_(torch.randn(cache.k.shape, generator=gen.manual_seed(1)))
        cache.v.copy_(torch.randn(cache.v.shape, generator=gen.manual_seed(2)))
    return graphed, eager


def replays(runner: ModelRunner, monkeypatch) -> list[PaddedSize]:
    """Records the size of every graph the runner replays."""
    replayed: list[PaddedSize] = []
    run = runner.graphs.run

    def recording(graph, requests):
        replayed.append(graph.size)
        return run(graph, requests)

    monkeypatch.setattr(runner.graphs, "run", recording)
    return replayed


DECODES = [TreeRequest(TokenTree.single(5), 30, [0, 1]), TreeRequest(TokenTree.single(7), 3, [2]),
           TreeRequest(TokenTree.single(9), 100, [3, 4, 5, 6, 7, 8, 9])]
TREES = [TreeRequest(TokenTree((5, 6, 7, 8), (-1, 0, 0, 1)), 40, [10, 11, 12]),
         TreeRequest(TokenTree.chain([3, 4]), 0, [13], "last"), TreeRequest(TokenTree.single(9), 17, [14, 15], [0])]


@pytest.mark.parametrize(("step", "size"), [(DECODES, (4, 4, 1)), (TREES, (8, 4, 4))], ids=["decodes", "trees"])
def test_a_step_that_fits_replays_the_smallest_graph_and_matches_the_eager_forward(model, monkeypatch, step, size):
    graphed, eager = runner_pair(model)
    untouched = graphed.kv_cache.k.clone()
    replayed = replays(graphed, monkeypatch)
    got, expected = graphed.forward(step), eager.forward(step)
    assert [(s.tokens, s.requests, s.width) for s in replayed] == [size]
    assert got.logit_starts == expected.logit_starts and got.token_starts == expected.token_starts
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(graphed.kv_cache.k, eager.kv_cache.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(graphed.kv_cache.v, eager.kv_cache.v, atol=1e-5, rtol=1e-5)
    written = torch.zeros(BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[graphed.metadata(step).slot_mapping.cpu()] = True
    flat = (BLOCKS * BLOCK_SIZE, -1)
    assert torch.equal(graphed.kv_cache.k[0].reshape(flat)[~written.to(DEVICE)],
                       untouched[0].reshape(flat)[~written.to(DEVICE)])  # padding wrote no slot


def test_hidden_states_a_graph_was_captured_with_come_back_as_copies_and_others_run_eagerly(model, monkeypatch):
    graphed, eager = runner_pair(model, hidden_sets=((), (1, 2)))
    replayed = replays(graphed, monkeypatch)
    got, expected = graphed.forward(TREES, hidden_at=(1, 2)), eager.forward(TREES, hidden_at=(1, 2))
    assert len(replayed) == 1 and set(got.hidden) == {1, 2}
    for k in (1, 2):
        torch.testing.assert_close(got.hidden[k], expected.hidden[k], atol=1e-5, rtol=1e-5)
    kept = {k: h.clone() for k, h in got.hidden.items()}
    logits = got.logits.clone()
    graphed.forward(DECODES, hidden_at=(1, 2))  # another replay rewrites the graph's outputs, not ours
    assert all(torch.equal(got.hidden[k], kept[k]) for k in kept) and torch.equal(got.logits, logits)
    graphed.forward(TREES, hidden_at=(1,))
    assert len(replayed) == 2  # no graph has (1,) alone: eager


@pytest.mark.parametrize("step", [
    [TreeRequest(TokenTree.chain([1] * 5), 0, [0])],  # wider than every captured tree
    [TreeRequest(TokenTree.chain([1] * 4), 0, [b]) for b in range(3)],  # 12 tokens: more than the largest
    [TreeRequest(TokenTree.single(1), 5, [0])] * 5,  # more requests than any size holds
], ids=["wide", "many-tokens", "many-requests"])
def test_a_step_no_size_fits_runs_eagerly(model, step):
    graphed, _ = runner_pair(model)
    assert graphed.graphs.find(step, ()) is None


def test_an_early_exit_runs_eagerly(model, monkeypatch):
    graphed, eager = runner_pair(model)
    replayed = replays(graphed, monkeypatch)
    got = graphed.forward(DECODES, num_layers=1)
    assert replayed == []
    torch.testing.assert_close(got.logits, eager.forward(DECODES, num_layers=1).logits, atol=1e-5, rtol=1e-5)


def test_sizes_cover_every_token_bucket_up_to_the_step_budget_for_decodes_and_trees():
    sizes = padded_sizes(512, 64, (1, 9), blocks=40, context=600)
    decodes = [s.tokens for s in sizes if s.width == 1]
    trees = [s for s in sizes if s.width == 9]
    assert decodes == [1, 2, 4, 8, 16, 32, 48, 64]  # a decode step has a token per request
    assert trees[-1].tokens == 512 and all(s.requests == min(s.tokens, 64) for s in trees)
    assert {s.width for s in padded_sizes(512, 64, (1, 100), 40, 600)} == {1, 64}  # the bitmask's limit


def generate(directory: Path, graphs: bool, device: str = DEVICE) -> tuple[list[list[int]], list[PaddedSize]]:
    """Greedy outputs of n-gram speculation (verification trees) on the tiny model, and the sizes
    of the graphs its steps replayed, with the engine's graphs (made on a CPU too: replayed eagerly) or none."""
    from specserve.llm import LLM
    from specserve.sampling import SamplingParams

    llm = LLM(str(directory), draft="ngram", dtype="float32", device=device, load_format="dummy",
              speculation="fixed", max_tree_tokens=3, max_num_seqs=4, max_num_batched_tokens=64,
              kv_cache_memory="4MiB", enforce_eager=not graphs)
    engine = llm.engine
    if graphs and engine.runner.graphs is None:
        engine._capture_graphs()
    replayed = []
    if engine.runner.graphs is not None:
        run = engine.runner.graphs.run
        engine.runner.graphs.run = lambda graph, requests: (replayed.append(graph.size), run(graph, requests))[1]
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [3, 4, 5]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], replayed


def test_an_engine_with_graphs_speculates_through_them_and_generates_what_it_does_eagerly(model, tmp_path):
    directory = tmp_path / "tiny"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(TINY))
    with_graphs, replayed = generate(directory, graphs=True)
    eager, none = generate(directory, graphs=False)
    assert with_graphs == eager and none == []
    assert {size.width for size in replayed} == {1, 4}  # decodes, and trees of up to 3 drafted nodes


@pytest.mark.cuda
def test_captured_graphs_replay_the_eager_forward_on_a_gpu(model, monkeypatch):
    graphed, eager = runner_pair(model, capture=True)
    replayed = replays(graphed, monkeypatch)
    for step in (DECODES, TREES, DECODES[:1]):
        torch.testing.assert_close(graphed.forward(step).logits, eager.forward(step).logits, atol=1e-4, rtol=1e-4)
    assert len(replayed) == 3
