"""Attention metadata: built on the host, placed on the model's device in one transfer, and
answering its size questions without reading back from that device."""

from __future__ import annotations

import pytest
import torch

from kernels.metadata import AttentionMetadata, PaddedSize, host_tensors, pack, unpack
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


def test_a_padded_step_adds_empty_requests_and_slotless_tokens_and_states_the_bounds_as_its_facts():
    trees = [TokenTree.chain([1, 2]), TokenTree((3, 4, 5), (-1, 0, 0))]
    size = PaddedSize(tokens=8, requests=4, width=4, blocks=3, context=64)
    host, facts = host_tensors(trees, [5, 17], [[2], [0, 1]], 16, bitmask=True, pad=size)
    starts, contexts, lens, tables, slots, positions, masks, bits = host
    assert starts.tolist() == [0, 2, 5, 5, 5] and lens.tolist() == [2, 3, 0, 0] and contexts.tolist() == [5, 17, 0, 0]
    assert tables.tolist() == [[2, 0, 0], [0, 1, 0], [0, 0, 0], [0, 0, 0]]
    assert slots.tolist() == [37, 38, 17, 18, 19, -1, -1, -1] and positions.tolist() == [5, 6, 17, 18, 18, 0, 0, 0]
    assert masks.shape == (4, 4, 4) and not masks[2:].any()
    assert bits.tolist() == [0b1, 0b11, 0b1, 0b11, 0b101, 0, 0, 0]
    assert (facts["max_tree_len"], facts["max_context_len"], facts["all_chains"]) == (4, 64, False)


@pytest.mark.parametrize(("trees", "contexts", "tables"), [
    ([TokenTree.chain([1] * 5)], [0], [[0]]),  # wider than the size
    ([TokenTree.single(1)] * 5, [0] * 5, [[0]] * 5),  # more requests
    ([TokenTree.single(1)], [100], [[0, 1, 2, 3, 4, 5, 6]]),  # a longer context and block table
])
def test_a_step_beyond_a_padded_size_does_not_fit_it(trees, contexts, tables):
    size = PaddedSize(tokens=8, requests=4, width=4, blocks=3, context=64)
    assert not size.fits([len(t) for t in trees], contexts, [len(t) for t in tables])
    with pytest.raises(ValueError, match="does not fit"):
        host_tensors(trees, contexts, tables, 16, pad=size)
