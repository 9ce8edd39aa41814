"""fp32 and bf16 tree attention on the CPU through our C++ kernel (`kernels/cpu/tree_attention.cpp`).

Same semantics as `kernels.reference` (which it shares the K/V writes and compaction with), but
each query row attends over exactly its visible keys in a fixed order: a row's result never
depends on the other rows of the step, so a token verified in a tree gets the very bits it
would get decoded alone, and greedy speculation equals plain decoding.
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.metadata import AttentionMetadata
from kernels.reference import compact_kv, write_kv

__all__ = ["compact_kv", "paged_tree_attention", "tree_attention", "write_kv"]


def paged_tree_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    return native.tree_attention(q, k_cache, v_cache, meta.query_start_loc, meta.context_lens, meta.block_tables,
                                 meta.ancestor_mask, scale)


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return paged_tree_attention(q, k_cache, v_cache, meta, scale)
