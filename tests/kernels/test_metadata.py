"""Attention metadata: built on the host, placed on the model's device in one transfer, and
answering its size questions without reading back from that device."""

from __future__ import annotations

import pytest
import torch

from kernels.metadata import AttentionMetadata, pack, unpack
from specserve.tree import TokenTree


def test_packed_tensors_come_back_as_they_were_whatever_their_types_and_order():
    tensors = [torch.tensor([True, False, True]), torch.arange(5, dtype=torch.int64) - 2,
               torch.tensor([[1.5, -2.0]]), torch.zeros(0, dtype=torch.int64), torch.tensor([7], dtype=torch.int32)]
    buffer, layout = pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    for offset, dtype, _ in layout:
        assert offset % dtype.itemsize == 0  # aligned: every view is legal on any device
    back = unpack(buffer.clone(), layout)
    for original, copy in zip(tensors, back, strict=True):
        assert copy.dtype == original.dtype and torch.equal(copy, original)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_metadata_on_a_device_equals_the_host_s_and_knows_its_sizes_from_the_host(device):
    trees = [TokenTree.chain([1, 2, 3]), TokenTree((4, 5, 6, 7), (-1, 0, 0, 1)), TokenTree.chain([8])]
    args = (trees, [0, 20, 5], [[3], [0, 1], [2]], 16)
    host = AttentionMetadata.build(*args)
    placed = AttentionMetadata.build(*args, device=device)
    for name in ("query_start_loc", "context_lens", "tree_lens", "block_tables", "slot_mapping", "positions",
                 "ancestor_mask"):
        assert getattr(placed, name).device.type == device
        assert torch.equal(getattr(placed, name).cpu(), getattr(host, name))
    assert (placed.max_tree_len, placed.max_context_len, placed.max_seq_len) == (4, 20, 24)
    assert not placed.is_rectangular and not placed.is_fresh_prefill
    assert AttentionMetadata.build([TokenTree.chain([1, 2])], [0], [[0]], 16).is_fresh_prefill
