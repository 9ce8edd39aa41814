"""Tensor parallelism over torch.distributed: the target split across N ranks of one machine.

Rank 0 is the engine (the driver): it schedules, drafts, verifies and samples. Ranks 1..N-1 are
worker processes holding their share of the weights and of the KV pool (their heads of the same
blocks, under the driver's one block manager). Every target forward is one `StepCall` the
driver broadcasts, so every rank runs the same trees through the same collectives and no rank
decides anything (ranks choosing their own draft lengths deadlocked vLLM, its issue 44185).

The split is Megatron's: q/k/v and gate/up column-parallel (whole heads, intermediate rows), o
and down row-parallel with one all-reduce after each, the LM head vocabulary-parallel (logit
columns all-gathered); embeddings and norms are replicated, drafters run on the driver alone.
gloo on CPUs, NCCL on GPUs (rank r on cuda:r).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specserve.kv_cache import KVCache
from specserve.model_runner import ForwardResult, ModelRunner, TreeRequest
from specserve.models.config import ModelConfig
from specserve.models.linear import Projection
from specserve.models.llama import LlamaForCausalLM

logger = logging.getLogger("specserve")

STARTUP_TIMEOUT_S = 600  # workers load their weights in this time, or the start fails
DEATH_GRACE_S = 10.0  # a rank died: the driver's collective should fail by then; else the process exits


class RankDiedError(RuntimeError):
    """A tensor-parallel worker exited: the engine cannot go on (its weights and K/V are gone)."""


# -- the split ------------------------------------------------------------------------------------

def check_shardable(config: ModelConfig, world: int) -> None:
    """Raise ValueError, saying what to change, unless `config` splits evenly over `world` ranks."""
    sizes = {"attention heads": config.num_heads, "KV heads": config.num_kv_heads,
             "intermediate size": config.intermediate_size}
    uneven = [f"{name} ({n})" for name, n in sizes.items() if n % world]
    if uneven:
        raise ValueError(f"tensor_parallel_size {world} does not divide the model's {', '.join(uneven)}: "
                         f"use a size that divides them")


def local_config(config: ModelConfig, world: int) -> ModelConfig:
    """The shapes one rank holds (its heads and intermediate rows): what its KV pool is sized by."""
    return replace(config, num_heads=config.num_heads // world, num_kv_heads=config.num_kv_heads // world,
                   intermediate_size=config.intermediate_size // world)


def _all_reduce(y: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(y)
    return y


def _gather_columns(y: torch.Tensor, world: int, vocab: int) -> torch.Tensor:
    """Every rank's logit columns, side by side (the last rank's padding cut off)."""
    parts = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(parts, y.contiguous())
    return torch.cat(parts, dim=-1)[:, :vocab]


class VocabParallelHead(Projection):
    """This rank's rows of the LM head, its logits gathered from every rank. The driver also
    keeps the whole head for drafters that score a part of the vocabulary (`select_rows`)."""

    def __init__(self, in_features: int, rows: int, full: Projection | None):
        super().__init__(in_features, [rows])
        self.full = full

    def select_rows(self, rows: torch.Tensor) -> Projection:
        if self.full is None:
            raise RuntimeError("only the driver (rank 0) drafts: workers hold a share of the LM head")
        return self.full.select_rows(rows)


COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows split (whole heads)
ROW_PARALLEL = ("o_proj", "down_proj")  # input columns split, the partial outputs summed


@dataclass(frozen=True)
class TensorShard:
    """Rank `rank`'s share of a target split `world` ways (`load_model(shard=...)`): the layers
    built at `local_config`'s sizes, each projection's tensor cut as the checkpoint is read; after
    loading, o/down sum over ranks and the LM head becomes vocabulary-parallel. `model.config`
    stays the whole model's."""

    rank: int
    world: int

    def local(self, config: ModelConfig) -> ModelConfig:
        check_shardable(config, self.world)
        return local_config(config, self.world)

    def tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        *_, module, kind = ("", "", *name.split("."))
        if module in COLUMN_PARALLEL:
            return torch.tensor_split(tensor, self.world)[self.rank].contiguous()
        if module in ROW_PARALLEL and kind == "weight":
            return torch.tensor_split(tensor, self.world, dim=1)[self.rank].contiguous()
        if module in ROW_PARALLEL:
            return tensor if self.rank == 0 else torch.zeros_like(tensor)  # the bias added once
        return tensor

    def finish(self, model: LlamaForCausalLM) -> None:
        for layer in model.layers:
            layer.self_attn.o_proj.collective = _all_reduce
            layer.mlp.down_proj.collective = _all_reduce
        model.lm_head = _vocab_shard(model.lm_head, self.rank, self.world, model.config.vocab_size)


def _vocab_shard(head: Projection, rank: int, world: int, vocab: int) -> VocabParallelHead:
    """The head's rows split `world` ways, every rank the same width (all_gather's), the last
    padded with zeros. The head is read whole (the driver keeps it for drafting), then cut."""
    if head.quantized or head.int8 is not None or head.fused_bias is not None:
        raise ValueError("tensor parallelism splits a plain LM head without bias")
    (weight,) = head.dense_blocks()
    rows = -(-vocab // world)
    mine = weight[rank * rows:(rank + 1) * rows]
    mine = torch.cat([mine, mine.new_zeros(rows - mine.shape[0], mine.shape[1])]).contiguous()
    shard = VocabParallelHead(head.in_features, rows, head if rank == 0 else None)
    shard.load([mine], None, head.packed is not None)
    shard.collective = partial(_gather_columns, world=world, vocab=vocab)
    return shard


# -- what the driver broadcasts ---------------------------------------------------------------------

@dataclass
class StepCall:
    """One thing every rank does together. `compactions` (accepted K/V moves since the last call)
    come first; then `method`: "pool" (make the KV pool), "forward", "run_layers", "profile" (a
    forward over a scratch pool, sizing a GPU's pool) or "stop"."""

    method: str
    requests: list[TreeRequest] = field(default_factory=list)
    hidden_at: tuple[int, ...] = ()
    num_layers: int | None = None
    compactions: list[tuple[list[int], list[int]]] = field(default_factory=list)
    pool: tuple[int, int, torch.dtype] | None = None  # blocks, block size, element type


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker loads: the driver's model, as the driver loads it."""

    model_path: str
    dtype: str | torch.dtype | None
    quantization: str
    load_format: str
    device: str  # "cpu" or "cuda"
    threads: int


def _broadcast(call: StepCall | None) -> StepCall:
    box = [call]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rank_device(kind: str, rank: int) -> torch.device:
    return torch.device("cpu") if kind == "cpu" else torch.device("cuda", rank)


def _pool(config: ModelConfig, world: int, pool: tuple[int, int, torch.dtype], device: torch.device) -> KVCache:
    blocks, block_size, dtype = pool
    return KVCache.for_model(local_config(config, world), blocks, block_size, dtype, device)


# -- the workers ----------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the driver dies, whatever it is blocked in (NCCL waits)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _backend(device: torch.device) -> str:
    return "gloo" if device.type == "cpu" else "nccl"


def _store(port: int, world: int, driver: bool) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world, is_master=driver, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))


def _worker_main(rank: int, world: int, port: int, spec: WorkerSpec) -> None:
    from specserve.models.loader import load_model

    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    try:
        torch.set_num_threads(spec.threads)
        device = _rank_device(spec.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = _store(port, world, driver=False)
        store.set(f"joined/{rank}", "1")  # the driver waits for these, watching for workers that died first
        dist.init_process_group(_backend(device), store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        model = load_model(spec.model_path, spec.dtype, spec.quantization, spec.load_format, device,
                           shard=TensorShard(rank, world))
        _serve(model, world, device)
        status = 0
    except Exception:  # noqa: BLE001 -- the driver sees the exit and fails the engine
        logger.exception("tensor-parallel rank %d failed", rank)
        status = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Out without the interpreter's teardown: there a C++ thread (gloo's) still joinable now and
    # then aborted the exit (SIGABRT, "terminate called without an active exception": 2-3 closes
    # in 24 on an AMD EPYC Zen 4 host), which the driver reads as a rank that failed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@torch.inference_mode()
def _serve(model: LlamaForCausalLM, world: int, device: torch.device) -> None:
    runner: ModelRunner | None = None
    while True:
        call = _broadcast(None)
        if call.method == "stop":
            return
        for src, dst in call.compactions:
            runner.kv_cache.compact(src, dst)
        if call.method == "pool":
            runner = ModelRunner(model, _pool(model.config, world, call.pool, device))
        elif call.method == "profile":
            ModelRunner(model, _pool(model.config, world, call.pool, device)).forward(call.requests)
        elif call.method == "forward":
            runner.forward(call.requests, call.hidden_at, call.num_layers)
        elif call.method == "run_layers":
            runner.run_layers(call.requests, call.num_layers)
        else:
            raise RuntimeError(f"unknown step call {call.method!r}")


# -- the driver -----------------------------------------------------------------------------------

class TensorParallelExecutor:
    """The driver's side: starts ranks 1..N-1, joins them in one process group as rank 0, and
    broadcasts `StepCall`s. A worker that exits fails the engine: while starting, at once; after,
    the driver's collectives raise `RankDiedError` (gloo notices the closed connection); where a
    collective cannot notice (NCCL waits for ever) a watchdog ends the process with status 1
    after `DEATH_GRACE_S`, so that a supervisor restarts it."""

    def __init__(self, world: int, spec: WorkerSpec, threads_before: int):
        self.world = world
        self._threads_before = threads_before  # the driver's CPU threads, given back on close
        self._closing = False
        self._failed: str | None = None
        self._busy_since: float | None = None  # when the driver entered collectives it may hang in
        # Called from the watchdog's thread once a worker has died (the server's engine loop stops on it).
        self.on_failure: Callable[[str], None] | None = None
        self.backend = _backend(_rank_device(spec.device, 0))
        store = _store(0, world, driver=True)  # the system picks the port: no race for a free one
        port = store.port
        context = mp.get_context("spawn")  # a fork would copy the driver's threads and CUDA state
        self.workers = [context.Process(target=_worker_main, args=(rank, world, port, spec), daemon=True,
                                        name=f"specserve-tp-rank-{rank}") for rank in range(1, world)]
        for worker in self.workers:
            worker.start()
        try:
            self._await_workers(store)
            threading.Thread(target=self._watch, name="specserve-tp-watchdog", daemon=True).start()
            with self.collectives():
                dist.init_process_group(self.backend, store=store, rank=0, world_size=world,
                                        timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        except BaseException:
            self._closing = True  # the watchdog stands down
            self._stop_workers(grace_s=0)
            torch.set_num_threads(threads_before)
            raise
        logger.info("tensor parallelism: %d ranks (%s), workers %s", world, self.backend,
                    ", ".join(str(w.pid) for w in self.workers))

    def _await_workers(self, store: dist.TCPStore) -> None:
        """Until every worker has joined the rendezvous; one that exits first (a crash on start, its
        traceback in the log above) fails the start at once rather than after the timeout."""
        keys = [f"joined/{rank}" for rank in range(1, self.world)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not store.check(keys):
            if dead := self.dead_workers():
                raise RankDiedError(f"tensor-parallel {', '.join(dead)} exited while starting (its log says why)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S} s")
            time.sleep(0.05)

    def dead_workers(self) -> list[str]:
        return [f"rank {rank} (pid {w.pid}, exit code {w.exitcode})"
                for rank, w in enumerate(self.workers, start=1) if w.exitcode is not None]

    def send(self, call: StepCall) -> None:
        with self.collectives():
            _broadcast(call)

    @contextlib.contextmanager
    def collectives(self) -> Iterator[None]:
        """Driver code taking part in collectives: a rank's death there raises `RankDiedError`."""
        if self._failed is not None:
            raise RankDiedError(self._failed)
        self._busy_since = time.monotonic()
        try:
            yield
        except RuntimeError as error:
            time.sleep(0.2)  # a worker's exit code lags its closed socket
            dead = self.dead_workers()
            if not dead:
                raise
            self._failed = f"tensor-parallel {', '.join(dead)} died: the engine cannot go on"
            raise RankDiedError(self._failed) from error
        finally:
            self._busy_since = None

    def _watch(self) -> None:
        while not self._closing:
            dead = self.dead_workers()
            if dead:
                message = f"tensor-parallel {', '.join(dead)} died: the engine cannot go on"
                logger.error("%s", message)
                if self._failed is None:
                    self._failed = message
                if self.on_failure is not None:
                    self.on_failure(message)
                deadline = time.monotonic() + DEATH_GRACE_S
                while time.monotonic() < deadline and self._busy_since is not None and not self._closing:
                    time.sleep(0.1)
                if self._busy_since is not None and not self._closing:
                    if self.backend != "nccl":
                        logger.critical("the driver is stuck in a collective with a dead rank")
                        return
                    logger.critical("the driver is stuck in a collective with a dead rank: exiting with status 1")
                    os._exit(1)
                return
            time.sleep(0.2)

    def close(self) -> None:
        """Stop the workers (they leave their loop) and leave the process group."""
        if self._closing:
            return
        self._closing = True
        if self._failed is None:
            with contextlib.suppress(RuntimeError):
                _broadcast(StepCall("stop"))
        self._stop_workers()
        if dist.is_initialized():
            with contextlib.suppress(RuntimeError):
                dist.destroy_process_group()
        torch.set_num_threads(self._threads_before)

    def _stop_workers(self, grace_s: float = 10) -> None:
        for worker in self.workers:
            worker.join(timeout=grace_s)
            if worker.exitcode is None:
                worker.kill()
                worker.join(timeout=5)


class TensorParallelRunner(ModelRunner):
    """The driver's runner: each target forward is broadcast to the workers, then run here as
    rank 0; compactions travel with the next call (workers need them only before a forward)."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, executor: TensorParallelExecutor):
        super().__init__(model, kv_cache)
        self.executor = executor
        self._compactions: list[tuple[list[int], list[int]]] = []
        executor.send(StepCall("pool", pool=(kv_cache.num_blocks, kv_cache.block_size, kv_cache.k.dtype)))

    @property
    def world_size(self) -> int:
        return self.executor.world

    def forward(self, requests: Sequence[TreeRequest], hidden_at: Sequence[int] = (),
                num_layers: int | None = None) -> ForwardResult:
        self._send("forward", requests, tuple(hidden_at), num_layers)
        with self.executor.collectives():
            return super().forward(requests, hidden_at, num_layers)

    def run_layers(self, requests: Sequence[TreeRequest], num_layers: int) -> torch.Tensor:
        self._send("run_layers", requests, (), num_layers)
        with self.executor.collectives():
            return super().run_layers(requests, num_layers)

    def compact(self, src_slots: list[int], dst_slots: list[int]) -> None:
        super().compact(src_slots, dst_slots)
        if src_slots:
            self._compactions.append((list(src_slots), list(dst_slots)))

    def _send(self, method: str, requests: Sequence[TreeRequest], hidden_at: tuple[int, ...],
              num_layers: int | None) -> None:
        compactions, self._compactions = self._compactions, []
        self.executor.send(StepCall(method, list(requests), hidden_at, num_layers, compactions))


def start_workers(world: int, model_path: str | Path, dtype: str | torch.dtype | None, quantization: str,
                  load_format: str, device: torch.device) -> TensorParallelExecutor:
    """Ranks 1..world-1 loading the model as the driver does; the CPU's threads shared among ranks."""
    before = torch.get_num_threads()
    threads = max(1, before // world) if device.type == "cpu" else before
    if device.type == "cpu":
        torch.set_num_threads(threads)  # the driver is a rank too
    elif device.index not in (None, 0):
        raise ValueError(f"tensor parallelism places rank r on cuda:r: serve on cuda:0, not {device}")
    elif torch.cuda.device_count() < world:
        raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    spec = WorkerSpec(str(model_path), dtype, quantization, load_format, device.type, threads)
    return TensorParallelExecutor(world, spec, before)
