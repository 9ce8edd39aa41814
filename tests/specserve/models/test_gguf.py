"""GGUF blocks kept quantized: every format decodes to exactly `gguf`'s own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specserve.models.gguf import DECODERS, BlockWeight, QuantizedRows, decode_blocks, hf_name, unpermute_order

# type -> (bytes per block, weights per block, byte offsets of its fp16 scales)
LAYOUTS = {"Q4_0": (18, 32, [0]), "Q4_1": (20, 32, [0, 2]), "Q5_0": (22, 32, [0]), "Q8_0": (34, 32, [0]),
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
    fused = QuantizedRows.stack([a, b])
    assert fused is not None and fused.shape == (6, 256)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    k4 = decode_blocks(random_blocks("Q4_K", 3, 256, seed=3), "Q4_K", 3)
    fused = QuantizedRows.stack([k4, k4])
    assert fused is not None and torch.equal(fused.dequantize(), torch.cat([k4.dequantize()] * 2))
    assert QuantizedRows.stack([a, decode_blocks(random_blocks("Q6_K", 2, 256), "Q6_K", 2)]) is None
    assert QuantizedRows.stack([k4, decode_blocks(random_blocks("Q6_K", 2, 256), "Q6_K", 2)]) is None


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


# -- a whole model from a GGUF file ---------------------------------------------------------------

# What each tensor is written as: mixed formats on purpose (v in Q4_0 among q/k in Q4_1: the fused
# q/k/v projection then runs its blocks apart), the head and embeddings in Q8_0 as SmolLM2 ships.
GGUF_TYPES = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_0", "attn_output": "Q8_0", "ffn_gate": "Q4_1",
              "ffn_up": "Q4_1", "ffn_down": "Q4_0", "token_embd": "Q8_0", "output": "Q8_0"}


def write_gguf(hf_dir, path):
    """The checkpoint in `hf_dir` as llama.cpp's converter writes it: GGUF names, q/k rows
    interleaved for its rotary layout, projections quantized, norms in F32."""
    import json

    from gguf import GGUFWriter
    from gguf.quants import quantize
    from safetensors.torch import load_file

    from specserve.models.gguf import GLOBAL_NAMES, LAYER_NAMES

    config = json.loads((hf_dir / "config.json").read_text())
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    to_gguf = {v: k for k, v in {**LAYER_NAMES, **GLOBAL_NAMES}.items()}  # names tested above
    writer = GGUFWriter(str(path), "llama")
    for name, tensor in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        short, kind = name.removeprefix("model.").rsplit(".", 1)
        if short.startswith("layers."):
            _, layer, module = short.split(".", 2)
            part = to_gguf[module]
            gguf_name = f"blk.{layer}.{part}.{kind}"
        else:
            part = to_gguf[short]
            gguf_name = f"{part}.{kind}"
        array = tensor.float().numpy()
        if part in heads:  # llama.cpp: w.reshape(heads, 2, rows // heads // 2, ...).swapaxes(1, 2)
            rows = array.shape[0]
            array = array.reshape(heads[part], 2, rows // heads[part] // 2, -1).swapaxes(1, 2).reshape(array.shape)
        if part in GGUF_TYPES and kind == "weight":
            kind_type = GGMLQuantizationType[GGUF_TYPES[part]]
            writer.add_tensor(gguf_name, quantize(array, kind_type), raw_dtype=kind_type)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def gguf_model(tiny_checkpoint, tmp_path, monkeypatch):
    from kernels import native
    from specserve.pull import GGUF_FILE

    native.load()  # built where the real cache keeps it; the prepared weights then go to a temporary one
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    directory = tiny_checkpoint("llama", seed=3, tie_word_embeddings=False)
    write_gguf(directory, directory / GGUF_FILE)
    return directory


def test_every_weight_is_the_files_own_dequantized_exactly(gguf_model):
    from gguf import GGUFReader

    from specserve.models.loader import load_model
    from specserve.pull import GGUF_FILE

    def dequantized(tensor) -> torch.Tensor:  # by gguf itself
        return torch.from_numpy(dequantize(tensor.data, tensor.tensor_type)).view(*reversed(tensor.shape.tolist()))

    model = load_model(gguf_model, torch.float32, quantization="none")
    tensors = {t.name: t for t in GGUFReader(gguf_model / GGUF_FILE).tensors}
    q_rows = unpermute_order(64, 4)  # 4 heads of 16: back to Hugging Face's order
    attn = model.layers[1].self_attn
    assert torch.equal(attn.qkv_proj.blocks[0], dequantized(tensors["blk.1.attn_q.weight"])[q_rows])
    assert torch.equal(attn.qkv_proj.blocks[2], dequantized(tensors["blk.1.attn_v.weight"]))
    assert torch.equal(model.layers[0].mlp.down_proj.blocks[0], dequantized(tensors["blk.0.ffn_down.weight"]))
    assert torch.equal(model.embed_tokens.weight, dequantized(tensors["token_embd.weight"]))
    assert torch.equal(model.norm.weight, dequantized(tensors["output_norm.weight"]))


def run_chain_and_decodes(model, prompt: list[int], new: list[int]):
    """Logits of `new` verified as one chain, and decoded one token at a time."""
    from specserve.kv_cache import KVCache
    from specserve.model_runner import ModelRunner, TreeRequest
    from specserve.tree import TokenTree

    def runner():
        run = ModelRunner(model, KVCache.for_model(model.config, 8, 16, model.dtype))
        run.forward([TreeRequest(TokenTree.chain(prompt), 0, list(range(8)))])
        return run

    chain = runner().forward([TreeRequest(TokenTree.chain(new), len(prompt), list(range(8)))])[0].logits
    alone, decoder = [], runner()
    for i, token in enumerate(new):
        step = TreeRequest(TokenTree.single(token), len(prompt) + i, list(range(8)))
        alone.append(decoder.forward([step])[0].logits[-1])
    return chain, torch.stack(alone)


def test_the_quantized_model_verifies_a_chain_with_the_bits_of_its_decodes(gguf_model):
    """Greedy speculation is exact against the model as served: every row as if alone."""
    from specserve.models.loader import load_model

    model = load_model(gguf_model)  # auto: the file's blocks
    assert model.weight_format() == "GGUF blocks Q4_0, Q4_1, Q8_0"
    chain, alone = run_chain_and_decodes(model, [5, 9, 2, 7, 1], [3, 8, 8, 4, 6, 2, 1, 9])
    assert torch.equal(chain, alone)
    exact, _ = run_chain_and_decodes(load_model(gguf_model, torch.float32, "none"), [5, 9, 2, 7, 1],
                                     [3, 8, 8, 4, 6, 2, 1, 9])
    # int8 activations are the only difference from the exact weights' model
    assert (chain - exact).norm() / exact.norm() < 0.05


@pytest.mark.parametrize("bits, tolerance", [(8, 0.5 / 127), (4, 0.5 / 15)])
def test_requantized_weights_are_within_half_a_step_of_the_plain_ones(bits, tolerance):
    weight = torch.randn(24, 96) * torch.logspace(-2, 1, 24).unsqueeze(1)
    blocks = BlockWeight.quantize(weight, bits)
    assert (blocks.bits, blocks.group, blocks.shape) == (bits, 32, (24, 96))
    spans = weight.view(24, 3, 32)
    span_range = (spans.amax(2) - spans.amin(2)) if bits == 4 else spans.abs().amax(2)
    error = (blocks.dequantize() - weight).abs().view(24, 3, 32).amax(2)
    assert (error <= span_range * tolerance * 1.001 + 1e-7).all()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_any_checkpoint_requantizes_and_verifies_with_the_bits_of_its_decodes(tiny_checkpoint, quantization):
    from specserve.models.loader import load_model

    directory = tiny_checkpoint("llama", seed=3, tie_word_embeddings=False)  # safetensors, no GGUF
    model = load_model(directory, quantization=quantization)
    assert model.weight_format() == f"requantized blocks {quantization}"
    chain, alone = run_chain_and_decodes(model, [5, 9, 2, 7, 1], [3, 8, 8, 4, 6, 2, 1, 9])
    assert torch.equal(chain, alone)
    exact, _ = run_chain_and_decodes(load_model(directory, torch.float32, "none"), [5, 9, 2, 7, 1],
                                     [3, 8, 8, 4, 6, 2, 1, 9])
    assert (chain - exact).norm() / exact.norm() < (0.05 if quantization == "int8" else 0.25)


def test_later_loads_map_the_prepared_weights_and_compute_the_same_bits(gguf_model, monkeypatch):
    """The first load saves the weights as the kernels take them; the next maps them, never
    reading the GGUF again, and its forward gives the same bits."""
    from specserve.models import loader, prepared
    from specserve.pull import GGUF_FILE

    first = loader.load_model(gguf_model)
    saved = prepared.prepared_path(gguf_model / GGUF_FILE)
    assert saved.exists()
    monkeypatch.setattr(loader, "GGUFWeights", None)  # the second load must not open the GGUF
    second = loader.load_model(gguf_model)
    assert second.weight_format() == first.weight_format()
    assert not any(t.is_meta for t in [*second.parameters(), *second.buffers()])
    assert torch.equal(run_chain_and_decodes(first, [5, 9, 2], [7, 1, 4])[0],
                       run_chain_and_decodes(second, [5, 9, 2], [7, 1, 4])[0])


def test_a_gguf_requantizes_from_its_own_values_and_keeps_both_prepared_versions(gguf_model, monkeypatch):
    """int4 from a GGUF: each projection's blocks requantized from their exact fp32 values (one
    fused weight however many formats it had), embeddings kept in the file's blocks; saved beside
    the file's own prepared weights, not over them, and mapped at the next load."""
    from specserve.models import loader, prepared
    from specserve.models.linear import Projection, QuantizedEmbedding
    from specserve.pull import GGUF_FILE

    own = loader.load_model(gguf_model)
    requantized = loader.load_model(gguf_model, quantization="int4")
    assert requantized.weight_format() == "requantized blocks int4"
    assert isinstance(requantized.embed_tokens, QuantizedEmbedding)
    for name, module in requantized.named_modules():
        if isinstance(module, Projection):
            exact = torch.cat([w.dequantize() for w in dict(own.named_modules())[name].quantized])
            (weight,) = module.quantized
            assert torch.equal(weight.codes, BlockWeight.quantize(exact, 4).codes)
    assert prepared.prepared_path(gguf_model / GGUF_FILE).exists()
    assert prepared.prepared_path(gguf_model / GGUF_FILE, 4).exists()
    monkeypatch.setattr(loader, "GGUFWeights", None)  # neither load may open the GGUF again
    assert loader.load_model(gguf_model, quantization="int4").weight_format() == "requantized blocks int4"
    assert loader.load_model(gguf_model).weight_format() == own.weight_format()


def test_an_unreadable_prepared_file_is_prepared_again(gguf_model):
    from specserve.models import loader, prepared
    from specserve.pull import GGUF_FILE

    loader.load_model(gguf_model)
    saved = prepared.prepared_path(gguf_model / GGUF_FILE)
    saved.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    model = loader.load_model(gguf_model)
    assert model.weight_format().startswith("GGUF blocks")
    assert prepared.load(saved, model.config).weight_format() == model.weight_format()


def test_prepared_files_map_empty_fields_too(tmp_path):
    """Q6_K has no minimums: its empty fields must survive the file (a mapped view cannot be empty)."""
    from safetensors.torch import save_file

    from specserve.models.loader import _mapped_tensors

    weight = decode_blocks(random_blocks("Q6_K", 16, 256), "Q6_K", 16)
    save_file({name: t.contiguous() for name, t in weight._tensors().items()}, str(tmp_path / "w.safetensors"))
    mapped = _mapped_tensors(tmp_path / "w.safetensors", [])
    assert {name: (t.shape, t.dtype) for name, t in mapped.items()} == \
        {name: (t.shape, t.dtype) for name, t in weight._tensors().items()}
    assert torch.equal(type(weight)(**mapped, bits=6, source_type="Q6_K").dequantize(), weight.dequantize())
