"""Paged KV storage: per layer `[num_blocks, block_size, num_kv_heads, head_dim]` for K and V
(an int8 cache: `head_dim` codes, then a scale byte per 32 channels, `kernels.reference`).

All layers live in one tensor each for K and V, so committing an accepted path (moving its
K/V to contiguous slots) is one indexed copy across every layer. Which blocks a request
owns is the block manager's business; this class only holds the tensors.
"""

from __future__ import annotations

import math
import mmap

import torch

from kernels import ops
from kernels.reference import row_width
from specserve.models.config import ModelConfig


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, row_width(head_dim, dtype))
        self.k = _lazily_zeroed(shape, dtype, device)
        self.v = _lazily_zeroed(shape, dtype, device)
        self.block_size = block_size

    @classmethod
    def for_model(
        cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device="cpu"
    ) -> KVCache:
        return cls(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype, device)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * row_width(config.head_dim, dtype) * element

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]

    def compact(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Move accepted K/V from `src_slots` to `dst_slots` in every layer (see `compaction_slots`)."""
        if not src_slots:
            return
        src = torch.as_tensor(src_slots, dtype=torch.int64, device=self.k.device)
        dst = torch.as_tensor(dst_slots, dtype=torch.int64, device=self.k.device)
        ops.compact_kv(self.k, src, dst)
        ops.compact_kv(self.v, src, dst)


def _lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled tensor. On the CPU it lives in an anonymous mapping (zero-filled by the OS, like
    calloc), so pages only take memory once a block is written: a large pool costs RSS as it fills,
    not at start-up. (`torch.zeros` writes every page at once.)"""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)  # the tensor keeps the mapping alive
