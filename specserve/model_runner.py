"""One forward step over many requests' token trees: prefill, decode and verification alike."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kernels.metadata import AttentionMetadata, PaddedSize
from specserve.cuda_graphs import CudaGraphs
from specserve.kv_cache import KVCache
from specserve.models.llama import DecoderLayer, LlamaForCausalLM
from specserve.tree import TokenTree

LogitsWanted = Literal["all", "last", "none"]


@dataclass
class TreeRequest:
    """One request's slice of a step: its tree, what is already cached, and where K/V go."""

    tree: TokenTree
    context_len: int
    block_table: Sequence[int]
    # Verification needs every node, a prefill chunk only its last, a drafter its frontier nodes.
    logits: LogitsWanted | Sequence[int] = "all"


@dataclass
class RequestRows:
    """One request's share of a forward."""

    logits: torch.Tensor  # [nodes asked for, vocab] fp32
    hidden: dict[int, torch.Tensor]  # layer boundary -> [tree nodes, hidden], as asked (`ForwardOutput.hidden`)


@dataclass
class ForwardResult:
    """A step's forward, flat: every request's logit rows in request order (what batched
    verification takes as it is), and where each request's rows and tokens start."""

    logits: torch.Tensor  # [rows asked for, vocab] fp32
    hidden: dict[int, torch.Tensor]  # layer boundary -> [step tokens, hidden]
    logit_starts: list[int]  # request b's rows: logit_starts[b] .. logit_starts[b + 1]
    token_starts: list[int]  # request b's tokens: token_starts[b] .. token_starts[b + 1]

    def __len__(self) -> int:
        return len(self.token_starts) - 1

    def __getitem__(self, b: int) -> RequestRows:
        """Request b's rows (views)."""
        if not 0 <= b < len(self):
            raise IndexError(f"request {b} of {len(self)}")
        tokens = slice(self.token_starts[b], self.token_starts[b + 1])
        return RequestRows(self.logits[self.logit_starts[b]:self.logit_starts[b + 1]],
                           {k: h[tokens] for k, h in self.hidden.items()})

    def __iter__(self) -> Iterator[RequestRows]:
        return (self[b] for b in range(len(self)))


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.graphs: CudaGraphs | None = None  # captured forwards for small steps (CUDA)

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @property
    def device(self) -> torch.device:
        return self.kv_cache.k.device

    @property
    def world_size(self) -> int:
        """Ranks the target is split over (`specserve.parallel`); 1 here."""
        return 1

    def metadata(self, requests: Sequence[TreeRequest]) -> AttentionMetadata:
        """The step's attention layout over the shared block tables (any cache of this pool's blocks),
        built on the host and placed on the cache's device."""
        return AttentionMetadata.build([r.tree for r in requests], [r.context_len for r in requests],
                                       [r.block_table for r in requests], self.block_size, self.device)

    @torch.inference_mode()
    def capture_graphs(self, sizes: Sequence[PaddedSize], hidden_sets: Sequence[Sequence[int]] = ((),),
                       capture: bool | None = None) -> None:
        """Capture the forwards of steps up to `sizes` (see `specserve.cuda_graphs`); from now on a
        step that fits one replays it. `capture=False` replays eagerly (a CPU runs the same buffers)."""
        self.graphs = CudaGraphs(self.model, self.kv_cache, sizes, hidden_sets, capture)
        self.graphs.capture_all()

    @torch.inference_mode()
    def forward(
        self, requests: Sequence[TreeRequest], hidden_at: Sequence[int] = (), num_layers: int | None = None
    ) -> ForwardResult:
        starts = [0, *itertools.accumulate(len(r.tree) for r in requests)]  # from the host: no read
        selected, counts = _logits_rows(requests, starts)
        if selected is not None:
            selected = selected.to(self.device, non_blocking=True)
        graph = None if self.graphs is None or num_layers is not None else self.graphs.find(requests, hidden_at)
        if graph is not None:
            normed, hidden = self.graphs.run(graph, requests)
            # Out of the graph's outputs, which the next replay rewrites: the logits and copies
            logits = self.model.score(normed[: starts[-1]] if selected is None else normed[selected])
            hidden = {k: h[: starts[-1]].clone() for k, h in hidden.items()}
        else:
            out = self.model(_input_ids(requests, self.device), self.metadata(requests), self.kv_cache,
                             logits_indices=selected, hidden_at=hidden_at, num_layers=num_layers)
            logits, hidden = out.logits, out.hidden
        return ForwardResult(logits, hidden, [0, *itertools.accumulate(counts)], starts)

    def compact(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Move accepted K/V into place (`KVCache.compact`)."""
        self.kv_cache.compact(src_slots, dst_slots)

    @torch.inference_mode()
    def run_layers(self, requests: Sequence[TreeRequest], num_layers: int) -> torch.Tensor:
        """The target's first `num_layers` layers over the requests' trees (writing their K/V):
        the residual stream out, [tokens, hidden] (an early-exit head drafts from it)."""
        return self.model.run_layers(_input_ids(requests, self.device), self.metadata(requests), self.kv_cache,
                                     num_layers)

    @torch.inference_mode()
    def run_layer(self, layer: DecoderLayer, kv_cache: KVCache, requests: Sequence[TreeRequest],
                  x: torch.Tensor, stack: torch.ScriptObject | None = None) -> torch.Tensor:
        """One more decoder layer of the target's shape (a drafter head's) over the requests'
        trees, from inputs `x` [tokens, hidden], its K/V in `kv_cache` (indexed by the same
        block tables): the residual stream out. `stack`: that layer as a `build_decoder_stack`
        (one C++ call instead of a dozen ops)."""
        meta = self.metadata(requests)
        cos, sin = self.model.rotary(meta.positions)
        if stack is None:
            out, delta = layer(x, None, cos, sin, kv_cache, meta)
        else:
            out, delta = stack.forward(x, None, cos, sin, kv_cache.k, kv_cache.v, meta.slot_mapping,
                                       meta.query_start_loc, meta.context_lens, meta.block_tables,
                                       meta.ancestor_mask, layer.self_attn.scale, 0, 1)
        return out + delta


def _input_ids(requests: Sequence[TreeRequest], device: torch.device) -> torch.Tensor:
    ids = torch.tensor([t for r in requests for t in r.tree.tokens], dtype=torch.int64)
    return ids if device.type == "cpu" else ids.pin_memory().to(device, non_blocking=True)


def _logits_rows(requests: Sequence[TreeRequest], starts: list[int]) -> tuple[torch.Tensor | None, list[int]]:
    """Flat token indices whose logits are wanted (None: every token's, in order), and how many
    belong to each request."""
    rows: list[int] = []
    counts: list[int] = []
    for b, r in enumerate(requests):
        start, end = starts[b], starts[b + 1]
        if isinstance(r.logits, str):
            wanted = {"all": range(start, end), "last": range(end - 1, end), "none": range(0)}[r.logits]
        else:
            wanted = [start + node for node in r.logits]
        rows.extend(wanted)
        counts.append(len(wanted))
    if len(rows) == starts[-1] and rows == list(range(starts[-1])):
        return None, counts
    return torch.tensor(rows, dtype=torch.int64), counts
