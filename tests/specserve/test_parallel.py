"""Tensor parallelism (gloo, CPU): two ranks generate exactly what one does, with and without
speculation and under preemption; an uneven split or a quantized target is refused up front; a
rank that dies fails the engine clearly (an error offline, status 1 for the server), never a hang."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.kv_cache import KVCache
from specserve.machine import free_port
from specserve.parallel import RankDiedError, TensorShard, check_shardable, local_config
from specserve.sampling import SamplingParams
from tests.conftest import dummy_model_dir

PROMPTS = [[1, 5, 9, 13, 2, 7] * 3, [4, 4, 4, 8], [30, 31, 32, 33, 30, 31, 32, 33, 30, 31], list(range(3, 40))]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # An odd vocabulary: the LM head's last share is padded, and the padding must be cut off.
    return dummy_model_dir(tmp_path_factory.mktemp("tp") / "dummy", vocab_size=401, eos_token_id=400)


def make_engine(model_dir: Path, world: int, **options) -> LLMEngine:
    options.setdefault("kv_cache_memory", "8MiB")
    return LLMEngine(model_dir, "float32", EngineConfig(load_format="dummy", device="cpu",
                                                        tensor_parallel_size=world, **options))


def generate(engine: LLMEngine, prompts: list[list[int]] = PROMPTS) -> tuple[list[list[int]], int]:
    """Greedy token ids per prompt, and the preemptions it took."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    engine.check_invariants()
    outputs = [done[str(i)] for i in range(len(prompts))]
    return [o.outputs[0].token_ids for o in outputs], sum(o.metrics.num_preemptions for o in outputs)


@pytest.fixture(scope="module")
def one_rank(model_dir) -> list[list[int]]:
    engine = make_engine(model_dir, 1, speculation="off")
    tokens, _ = generate(engine)
    return tokens


@pytest.mark.parametrize("draft", ["none", "ngram", "draft-model", "early-exit:1"])
def test_two_ranks_generate_what_one_rank_does(model_dir, one_rank, draft):
    draft = str(model_dir) if draft == "draft-model" else draft  # the target itself: long acceptances
    engine = make_engine(model_dir, 2, draft=draft, speculation="off" if draft == "none" else "fixed")
    try:
        tokens, _ = generate(engine)
        if draft != "none":
            assert engine.metrics.spec.accepted_tokens > 0, "steps must have verified and accepted drafted tokens"
    finally:
        engine.close()
    assert tokens == one_rank
    assert all(w.exitcode == 0 for w in engine.executor.workers), "workers leave cleanly on close"


@pytest.fixture(scope="module")
def heads(tiny_chat_model, tmp_path_factory) -> dict[str, Path]:
    """A random head of each kind for the tiny chat model (drafts that are often wrong)."""
    from drafters.heads import HeadConfig, save_head, target_fingerprint
    from specserve.models.loader import load_model
    from specserve.training.heads import TrainableHead

    target = load_model(tiny_chat_model, torch.float32)
    vocab = target.config.vocab_size
    out = {}
    for kind, layer in (("feature", target.config.num_layers), ("early-exit", 1)):
        torch.manual_seed(3)
        head = TrainableHead(target, kind, layer, torch.arange(vocab))
        directory = tmp_path_factory.mktemp(f"tp-head-{kind}")
        config = HeadConfig(kind, "tiny", target_fingerprint(tiny_chat_model), layer, vocab)
        save_head(directory, config, head.tensors())
        out[kind] = directory
    return out


@pytest.mark.parametrize("kind", ["feature", "early-exit"])
def test_two_ranks_draft_with_a_trained_head_as_one_rank_does(tiny_chat_model, heads, kind):
    """Heads run on the driver over the split target's hidden states, scoring with its whole LM head."""
    def run(world: int) -> tuple[list[list[int]], int, int]:
        engine = LLMEngine(tiny_chat_model, "float32", EngineConfig(
            kv_cache_memory="16MiB", tensor_parallel_size=world, draft=f"{kind}:{heads[kind]}", speculation="fixed"))
        try:
            tokens, _ = generate(engine)
            return tokens, engine.metrics.spec.drafted_tokens, engine.metrics.spec.accepted_tokens
        finally:
            engine.close()

    one, two = run(1), run(2)
    assert one[1] > 0
    assert two == one, "the same tokens, the same trees drafted, the same accepted"


def test_one_rank_through_the_worker_path_generates_what_the_plain_engine_does(model_dir, one_rank):
    threads = torch.get_num_threads()
    engine = make_engine(model_dir, 1, draft="ngram", speculation="fixed", distributed_executor="mp")
    try:
        assert engine.executor is not None and engine.executor.world == 1
        tokens, _ = generate(engine)
    finally:
        engine.close()
    assert tokens == one_rank
    assert torch.get_num_threads() == threads, "the driver's CPU threads are given back on close"


@pytest.mark.cuda
@pytest.mark.parametrize("world", [1, 2])
def test_nccl_ranks_generate_what_one_gpu_does(model_dir, world):
    """On GPUs: one rank through NCCL and the step broadcast (any GPU), two where there are two."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")

    def run(**options) -> list[list[int]]:
        engine = LLMEngine(model_dir, "float32", EngineConfig(load_format="dummy", device="cuda", draft="ngram",
                                                              speculation="fixed", enforce_eager=True, **options))
        try:
            return generate(engine)[0]
        finally:
            engine.close()

    assert run(tensor_parallel_size=world, distributed_executor="mp") == run()


def test_two_ranks_under_preemption(model_dir, one_rank):
    per_rank_block = KVCache.bytes_per_block(local_config(make_config(model_dir), 2), 16, torch.float32)
    longest = max(len(p) for p in PROMPTS) + MAX_TOKENS
    engine = make_engine(model_dir, 2, draft="ngram", speculation="fixed", enable_prefix_caching=False,
                         kv_cache_memory=per_rank_block * (longest // 16 + 4), schedule_conservativeness=0)
    try:
        tokens, preemptions = generate(engine, PROMPTS * 4)  # sixteen requests where room is for two or three
    finally:
        engine.close()
    assert preemptions > 0, "the small pool should have forced preemptions"
    assert tokens == one_rank * 4


def make_config(model_dir: Path):
    from specserve.models.config import ModelConfig

    return ModelConfig.from_dir(model_dir)


def test_each_rank_loads_only_its_share_of_every_projection(tiny_checkpoint):
    """Cut as the checkpoint is read: the ranks' shares side by side are the whole model's weights."""
    from specserve.models.loader import load_model

    path = tiny_checkpoint("qwen2", vocab_size=211)  # biases on q/k/v; an odd vocabulary
    whole = load_model(path, torch.float32, "none")
    ranks = [load_model(path, torch.float32, "none", shard=TensorShard(rank, 2)) for rank in range(2)]
    assert all(r.config == whole.config for r in ranks), "the config stays the whole model's"
    for i, layer in enumerate(whole.layers):
        parts = [r.layers[i] for r in ranks]
        for name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
            shares = [p.get_submodule(name).dense_blocks() for p in parts]
            for block, pieces in zip(layer.get_submodule(name).dense_blocks(), zip(*shares, strict=True),
                                     strict=True):
                assert all(piece.shape[0] == block.shape[0] // 2 for piece in pieces)
                assert torch.equal(torch.cat(pieces), block)
        for rank, part in enumerate(parts):
            biases = [b.tensor_split(2)[rank] for b in layer.self_attn.qkv_proj.dense_biases()]
            assert torch.equal(part.self_attn.qkv_proj.fused_bias, torch.cat(biases))
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            (block,) = layer.get_submodule(name).dense_blocks()
            pieces = [p.get_submodule(name).dense_blocks()[0] for p in parts]
            assert torch.equal(torch.cat(pieces, dim=1), block)
        assert parts[0].self_attn.num_heads == layer.self_attn.num_heads // 2
    (head,) = whole.lm_head.dense_blocks()
    shares = torch.cat([r.lm_head.dense_blocks()[0] for r in ranks])
    assert shares.shape[0] == 212 and torch.equal(shares[:211], head) and not shares[211:].any()
    assert ranks[0].lm_head.full is not None and ranks[1].lm_head.full is None, "only the driver drafts"


def test_a_split_that_does_not_divide_the_heads_is_refused(model_dir):
    with pytest.raises(ValueError, match=r"does not divide the model's KV heads \(2\)"):
        check_shardable(make_config(model_dir), 4)
    with pytest.raises(ValueError, match="does not divide"):
        make_engine(model_dir, 3)


def test_quantized_kernels_are_refused_with_tensor_parallelism():
    with pytest.raises(ValueError, match="with tensor parallelism use auto or none"):
        EngineConfig(tensor_parallel_size=2, quantization="int4")
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig(tensor_parallel_size=0)


def test_a_dead_rank_fails_the_engine_with_an_error(model_dir):
    engine = make_engine(model_dir, 2, draft="ngram")
    try:
        engine.executor.workers[0].kill()
        engine.executor.workers[0].join(timeout=10)
        engine.add_request("0", PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
        started = time.monotonic()
        with pytest.raises(RankDiedError, match="rank 1 .* died"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - started < 30
        with pytest.raises(RankDiedError):  # and stays failed
            engine.step()
    finally:
        engine.close()


def test_a_rank_that_cannot_start_fails_the_engine_at_once(model_dir, tmp_path, monkeypatch):
    """A worker that crashes before joining (here: a module shadowing ours on the path it inherits)
    fails the start with an error naming it, within seconds, and the driver's process goes on."""
    (tmp_path / "kernels.py").write_text("raise ImportError('a module that shadows the kernels package')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers start with the driver's sys.path
    threads = torch.get_num_threads()
    started = time.monotonic()
    with pytest.raises(RankDiedError, match=r"rank 1 \(pid \d+, exit code 1\) exited while starting"):
        make_engine(model_dir, 2)
    assert time.monotonic() - started < 60
    assert torch.get_num_threads() == threads, "the driver's CPU threads are given back"


@pytest.mark.parametrize("when", ["idle", "serving"])
def test_the_server_exits_with_status_1_when_a_rank_dies(model_dir, when):
    """The server, idle or mid-request, logs which rank died and exits 1 (a supervisor restarts it)."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", "serve", "--target", str(model_dir), "--load-format", "dummy",
         "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2", "--kv-cache-memory", "8MiB",
         "--draft", "none", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parents[2])
    log: list[str] = []
    try:
        workers = _read_until(server, log, re.compile(r"tensor parallelism: 2 ranks \(gloo\), workers (\d+)"))
        _read_until(server, log, re.compile(r"Uvicorn running"))
        client = threading.Thread(target=_stream_long_completion, args=(port,), daemon=True)
        if when == "serving":  # a long request in flight when the rank goes
            client.start()
            time.sleep(1.0)
        os.kill(int(workers.group(1)), signal.SIGKILL)
        status = server.wait(timeout=60)
        log.append(server.stdout.read())
        if client.is_alive():
            client.join(timeout=30)
        assert not client.is_alive(), "the client's stream must end when the server goes"
    finally:
        if server.poll() is None:
            server.kill()
    text = "".join(log)
    assert status == 1, text[-3000:]
    assert re.search(r"tensor-parallel rank 1 \(pid \d+, exit code -9\) died", text), text[-3000:]


def _stream_long_completion(port: int) -> None:
    body = {"model": "x", "prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True, "stream": True}
    url = f"http://127.0.0.1:{port}/v1/completions"
    with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", url, json=body, timeout=60) as response:
        for _ in response.iter_lines():
            pass


def _read_until(process: subprocess.Popen, log: list[str], pattern: re.Pattern, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"the server exited ({process.poll()}) before {pattern.pattern!r}:\n"
                                 + "".join(log)[-3000:])
        log.append(line)
        match = pattern.search(line)
        if match:
            return match
    raise AssertionError(f"no {pattern.pattern!r} within {timeout} s:\n" + "".join(log)[-3000:])


