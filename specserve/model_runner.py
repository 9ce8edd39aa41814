"""One forward step over many requests' token trees: prefill, decode and verification alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kernels.metadata import AttentionMetadata
from specserve.kv_cache import KVCache
from specserve.models.llama import LlamaForCausalLM
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
class RequestOutput:
    logits: torch.Tensor  # [nodes asked for, vocab] fp32
    hidden: dict[int, torch.Tensor]  # layer boundary -> [tree nodes, hidden], as asked (`ForwardOutput.hidden`)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @torch.inference_mode()
    def forward(
        self, requests: Sequence[TreeRequest], hidden_at: Sequence[int] = (), num_layers: int | None = None
    ) -> list[RequestOutput]:
        meta = AttentionMetadata.build(
            [r.tree for r in requests],
            [r.context_len for r in requests],
            [r.block_table for r in requests],
            self.block_size,
        )
        input_ids = torch.tensor([t for r in requests for t in r.tree.tokens], dtype=torch.int64)
        selected, counts = _logits_rows(requests, meta)
        out = self.model(input_ids, meta, self.kv_cache, logits_indices=selected, hidden_at=hidden_at,
                         num_layers=num_layers)
        logits = out.logits.split(counts)
        starts = meta.query_start_loc.tolist()
        return [
            RequestOutput(
                logits=logits[b],
                hidden={k: h[starts[b] : starts[b + 1]] for k, h in out.hidden.items()},
            )
            for b in range(len(requests))
        ]


def _logits_rows(requests: Sequence[TreeRequest], meta: AttentionMetadata) -> tuple[torch.Tensor, list[int]]:
    """Flat token indices whose logits are wanted, and how many belong to each request."""
    rows: list[int] = []
    counts: list[int] = []
    starts = meta.query_start_loc.tolist()
    for b, r in enumerate(requests):
        start, end = starts[b], starts[b + 1]
        if isinstance(r.logits, str):
            wanted = {"all": range(start, end), "last": range(end - 1, end), "none": range(0)}[r.logits]
        else:
            wanted = [start + node for node in r.logits]
        rows.extend(wanted)
        counts.append(len(wanted))
    return torch.tensor(rows, dtype=torch.int64), counts
