"""GGUF blocks kept quantized: every format decodes to exactly `gguf`'s own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specserve.models.gguf import DECODERS, BlockWeight, decode_blocks, hf_name, unpermute_order

# type -> (bytes per block, weights per block, byte offsets of its fp16 scales)
LAYOUTS = {"Q4_0": (18, 32, [0]), "Q4_1": (20, 32, [0, 2]), "Q8_0": (34, 32, [0]),
           "Q4_K": (144, 256, [0, 2]), "Q6_K": (210, 256, [208])}


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks whose fp16 scales are finite (of both signs), codes anything."""
    block_bytes, block_size, scale_offsets = LAYOUTS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        scales = (rng.standard_normal((rows, cols // block_size)) * 0.02).astype(np.float16)
        raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(rows, cols // block_size, 2)
    return raw.reshape(rows, -1)


def test_every_shipped_format_has_a_decoder():
    assert set(LAYOUTS) == set(DECODERS)


@pytest.mark.parametrize("type_name", sorted(LAYOUTS))
def test_dequantization_equals_gguf_bit_for_bit(type_name):
    rows, cols = 6, 512
    raw = random_blocks(type_name, rows, cols)
    expected = dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols)
    ours = decode_blocks(raw, type_name, rows).dequantize().numpy()
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("type_name", sorted(LAYOUTS))
def test_rows_dequantize_alone_as_in_the_whole(type_name):
    weight = decode_blocks(random_blocks(type_name, 9, 256), type_name, 9)
    rows = torch.tensor([7, 0, 3])
    assert torch.equal(weight.dequantize(rows), weight.dequantize()[rows])
    assert torch.equal(weight.permute_rows(rows).dequantize(), weight.dequantize()[rows])


def test_stacking_fuses_one_layout_and_refuses_mixed_ones():
    a = decode_blocks(random_blocks("Q4_1", 4, 256, seed=1), "Q4_1", 4)
    b = decode_blocks(random_blocks("Q4_1", 2, 256, seed=2), "Q4_1", 2)
    fused = BlockWeight.stack([a, b])
    assert fused is not None and fused.shape == (6, 256)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert BlockWeight.stack([a, decode_blocks(random_blocks("Q6_K", 2, 256), "Q6_K", 2)]) is None


def test_names_map_onto_hugging_face_ones():
    assert hf_name("blk.3.attn_q.weight") == "layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "layers.0.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "embed_tokens.weight"
    assert hf_name("output_norm.weight") == "norm.weight"
    assert hf_name("rope_freqs.weight") is None


def test_unpermuting_inverts_llama_cpp_rotary_interleave():
    heads, rows = 3, 18  # three rotary pairs per head: the order is not its own inverse
    hf = torch.arange(rows)
    # llama.cpp's converter: w.reshape(heads, 2, dim // 2).swapaxes(1, 2)
    gguf_order = hf.view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)
    assert torch.equal(gguf_order[unpermute_order(rows, heads)], hf)
