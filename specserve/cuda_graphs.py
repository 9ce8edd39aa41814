"""CUDA graphs: small steps (decodes, verification trees) replayed whole instead of launched op by op.

A small step's GPU work takes less time than launching its hundreds of kernels from Python, so,
as vLLM and SGLang do for decode batches, a target forward is captured once per padded size at
start-up and replayed. A step fits a size when its tokens, requests, longest tree, block tables
and contexts are within it (`PaddedSize`): it is padded to the smallest size it fits, its metadata
and input ids copied into that graph's buffer in one transfer, and the graph replayed. Larger
steps (prompt chunks), early exits and hidden states no graph was captured with run eagerly.

Sizes: tokens per step in `TOKEN_BUCKETS` up to 512, for trees of one node (decodes) and of up to
the widest tree a step may verify. Every graph shares one memory pool and one input buffer:
steps run one at a time, and what a replay returns is copied out before the next.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from kernels.metadata import AttentionMetadata, Layout, PaddedSize, host_tensors, pack, unpack
from specserve.kv_cache import KVCache
from specserve.models.llama import LlamaForCausalLM
from specserve.tree import TokenTree

if TYPE_CHECKING:
    from specserve.model_runner import TreeRequest

logger = logging.getLogger(__name__)

TOKEN_BUCKETS = (1, 2, 4, 8, *range(16, 513, 16))
MAX_WIDTH = 64  # trees of at most this many nodes: the Triton kernel's bitmask
WARMUP_CONTEXT = 512  # tokens of context each request of a warm-up step attends (tunes the kernel)


def padded_sizes(max_tokens: int, max_requests: int, widths: Sequence[int], blocks: int,
                 context: int) -> list[PaddedSize]:
    """The sizes to capture: every token bucket up to `max_tokens` (and 512) for each tree width,
    with as many requests as the tokens allow up to `max_requests`."""
    sizes = set()
    for width in {min(w, MAX_WIDTH) for w in widths}:
        most = min(max_tokens, max_requests * width, TOKEN_BUCKETS[-1])
        for tokens in TOKEN_BUCKETS:
            if tokens <= most:
                sizes.add(PaddedSize(tokens, min(tokens, max_requests), width, blocks, context))
    return sorted(sizes)


@dataclass
class _Graph:
    size: PaddedSize
    hidden_at: tuple[int, ...]
    layout: Layout  # the packed metadata and input ids, in the shared input buffer
    replay: Callable[[], None]
    # The forward's final-normed states and hidden states over every padded row, rewritten by each
    # replay. Not its logits: a vocabulary's worth per row, per graph, is gigabytes over all sizes.
    output: tuple[torch.Tensor, dict[int, torch.Tensor]]


class CudaGraphs:
    """The target's forwards captured per padded size (and per set of hidden states drafters read).

    `capture=False` (anywhere but CUDA: the tests) replays by running the forward over the same
    static buffers eagerly, so padding and buffers are checked without a GPU."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, sizes: Sequence[PaddedSize],
                 hidden_sets: Sequence[Sequence[int]] = ((),), capture: bool | None = None):
        device = kv_cache.k.device
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.capture = device.type == "cuda" if capture is None else capture
        self.sizes = sorted(sizes)
        self.hidden_sets = sorted({tuple(sorted(set(h))) for h in hidden_sets})
        self._graphs: dict[tuple[PaddedSize, tuple[int, ...]], _Graph] = {}
        self._by_width: dict[int, list[PaddedSize]] = {}
        for size in self.sizes:
            self._by_width.setdefault(size.width, []).append(size)
        self._widths = sorted(self._by_width)
        self._tokens = {width: [s.tokens for s in sizes] for width, sizes in self._by_width.items()}
        largest = max((len(pack(self._inputs(size, *self._warmup_step(size)))[0]) for size in self.sizes), default=0)
        self._buffer = torch.empty(largest, dtype=torch.uint8, device=device)
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def __len__(self) -> int:
        return len(self._graphs)

    def capture_all(self) -> None:
        """Capture every size for every hidden set, largest first (the smaller reuse its pool memory)."""
        keys = [(size, hidden) for size in reversed(self.sizes) for hidden in self.hidden_sets]
        for size, hidden in tqdm(keys, desc="capturing CUDA graphs", unit="graph", disable=not self.capture):
            self._graphs[(size, hidden)] = self._capture(size, hidden)
        logger.info("captured %d CUDA graphs: steps of up to %d tokens, trees of up to %d nodes", len(self),
                    max((s.tokens for s in self.sizes), default=0), max(self._widths, default=0))

    def find(self, requests: Sequence[TreeRequest], hidden_at: Sequence[int]) -> _Graph | None:
        """The smallest captured graph the step fits (None: run it eagerly)."""
        hidden = tuple(sorted(set(hidden_at)))
        width_at = bisect.bisect_left(self._widths, max(len(r.tree) for r in requests))
        if width_at == len(self._widths):
            return None
        width = self._widths[width_at]
        sizes = self._by_width[width]
        tokens = sum(len(r.tree) for r in requests)
        for size in sizes[bisect.bisect_left(self._tokens[width], tokens):]:
            if size.fits([len(r.tree) for r in requests], [r.context_len for r in requests],
                         [len(r.block_table) for r in requests]):
                return self._graphs.get((size, hidden))
        return None

    def run(self, graph: _Graph, requests: Sequence[TreeRequest]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Replay `graph` over the step: the final-normed and hidden states of every padded row (the
        step's first), valid until the next replay."""
        trees = [r.tree for r in requests]
        inputs = self._inputs(graph.size, trees, [r.context_len for r in requests], [r.block_table for r in requests])
        packed, layout = pack(inputs, pin=self.device.type == "cuda")
        if layout != graph.layout:
            raise RuntimeError(f"a step padded to {graph.size} packed as {layout}, not as captured")
        self._buffer[: len(packed)].copy_(packed, non_blocking=True)
        graph.replay()
        return graph.output

    def _inputs(self, size: PaddedSize, trees: Sequence[TokenTree], context_lens: Sequence[int],
                block_tables: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The step's metadata padded to `size`, then its input ids (padding: token 0)."""
        host, _ = host_tensors(trees, context_lens, block_tables, self.kv_cache.block_size, bitmask=True, pad=size)
        ids = [t for tree in trees for t in tree.tokens]
        return [*host, torch.tensor(ids + [0] * (size.tokens - len(ids)), dtype=torch.int64)]

    def _capture(self, size: PaddedSize, hidden_at: tuple[int, ...]) -> _Graph:
        trees, context_lens, tables = self._warmup_step(size)
        inputs = self._inputs(size, trees, context_lens, tables)
        packed, layout = pack(inputs)
        self._buffer[: len(packed)].copy_(packed)
        *meta_tensors, input_ids = unpack(self._buffer, layout)
        _, facts = host_tensors(trees, context_lens, tables, self.kv_cache.block_size, bitmask=True, pad=size)
        meta = AttentionMetadata.from_host(self.kv_cache.block_size, meta_tensors, facts)

        def forward() -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
            return self.model.final_hidden(input_ids, meta, self.kv_cache, hidden_at=hidden_at)

        if not self.capture:
            normed, hidden = forward()

            def rerun() -> None:
                fresh_normed, fresh_hidden = forward()
                normed.copy_(fresh_normed)
                for k, h in fresh_hidden.items():
                    hidden[k].copy_(h)

            return _Graph(size, hidden_at, layout, rerun, (normed, hidden))
        forward()  # compiles and tunes the Triton kernels, and lets cuBLAS allocate, outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = forward()
        return _Graph(size, hidden_at, layout, graph.replay, output)

    def _warmup_step(self, size: PaddedSize) -> tuple[list[TokenTree], list[int], list[list[int]]]:
        """A step of the size's widest trees over some context (what captures and tunes its graph).
        Its K/V land in the pool's first blocks, free at start-up."""
        count = max(1, min(size.requests, size.tokens // size.width))
        width = min(size.width, size.tokens)
        room = min(size.blocks, self.kv_cache.num_blocks) * self.kv_cache.block_size - width
        context = max(0, min(WARMUP_CONTEXT, size.context - width, room))  # positions within the model's
        table = list(range(-(-(context + width) // self.kv_cache.block_size)))
        return [TokenTree.chain([0] * width)] * count, [context] * count, [table] * count
