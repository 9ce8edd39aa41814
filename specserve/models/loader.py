"""Load a Hugging Face-style directory (config.json + safetensors) into our model.

The model is built on the meta device (no memory, no init cost); then each module takes its
tensors from the checkpoint: norms and embeddings as parameters, projections as blocks
(q/k/v, gate/up) that `Projection` fuses, packs or keeps plain (see `specserve.models.linear`).
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn

from specserve.models import prepared
from specserve.models.config import ModelConfig
from specserve.models.dummy import dummy_tensors
from specserve.models.gguf import GGUFWeights, QuantizedRows
from specserve.models.huge_pages import move_tiles_to_huge_pages
from specserve.models.linear import Projection, QuantizedEmbedding, packing_available
from specserve.models.llama import DecoderLayer, LlamaForCausalLM
from specserve.pull import GGUF_FILE

log = logging.getLogger(__name__)

# auto: a GGUF's own quantized blocks (fp32 activations), else the checkpoint's weights;
# none: plain weights, a GGUF's dequantized exactly (see `load_gguf`);
# int8 / int4: any checkpoint's plain weights requantized into blocks (`BlockWeight.quantize`).
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# auto: the directory's weights (GGUF or safetensors); dummy: random ones at its config's shape
LOAD_FORMATS = ("auto", "dummy")
REQUANTIZE_BITS = {"int8": 8, "int4": 4}
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8,
                      "I8": torch.int8, "I32": torch.int32}


def default_dtype() -> torch.dtype:
    """bf16 where the CPU has native bf16 (AVX512-BF16 / AMX), else fp32."""
    try:
        return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    except (AttributeError, RuntimeError):
        return torch.float32


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype:
    if name is None or name == "auto":
        return default_dtype()
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; use one of: float32, bfloat16, float16")
    return table[name]


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}: is it a Hugging Face model directory?")
    return files


def _header(file: Path) -> tuple[int, dict]:
    """A safetensors file's header length and its tensor entries (name -> dtype, shape, offsets)."""
    with open(file, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return length, header


def _mapped_tensors(file: Path, mappings: list[mmap.mmap]) -> dict[str, torch.Tensor]:
    """Zero-copy views of a safetensors file (private, copy-on-write mapping)."""
    header_len, header = _header(file)
    with open(file, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    mappings.append(mapping)
    tensors = {}
    for name, info in header.items():
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        count, offset = (end - start) // dtype.itemsize, 8 + header_len + start
        if count == 0:  # frombuffer refuses empty views
            tensors[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        tensors[name] = torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset).view(info["shape"])
    return tensors


def _read_tensors(path: Path, mappings: list[mmap.mmap] | None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint; memory-mapped (views) when `mappings` collects the maps."""
    tensors = {}
    for file in _checkpoint_files(path):
        if mappings is not None:
            tensors.update(_mapped_tensors(file, mappings))
        else:
            with safe_open(str(file), framework="pt") as f:
                tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return {name.removeprefix("model."): t for name, t in tensors.items() if "rotary_emb" not in name}


def _checkpoint_dtypes(path: Path) -> set[torch.dtype | None]:
    return {SAFETENSORS_DTYPES.get(v["dtype"]) for f in _checkpoint_files(path) for v in _header(f)[1].values()}


class Sharding(Protocol):
    """One tensor-parallel rank's share of the model (`specserve.parallel.TensorShard`): the model
    is built at `local` sizes, each tensor cut to the rank's share as it is read (`tensor`: before
    it reaches the device), and the result joined to the other ranks by `finish`."""

    def local(self, config: ModelConfig) -> ModelConfig: ...

    def tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor: ...

    def finish(self, model: LlamaForCausalLM) -> None: ...


def _whole(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class Checkpoint:
    """Hands out tensors by name in the model's dtype (cut by `cut`: a rank's share) and remembers
    what was never asked for."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, path: Path,
                 device: torch.device | str = "cpu", cut: Callable[[str, torch.Tensor], torch.Tensor] = _whole):
        self.tensors, self.dtype, self.path, self.device = tensors, dtype, path, torch.device(device)
        self.cut = cut

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"checkpoint in {self.path} has no tensor {name!r}: is it a Llama-family model?")
        tensor = self.cut(name, self.tensors.pop(name))
        return tensor.to(device=self.device, dtype=self.dtype)  # itself where both match

    def parameter(self, name: str) -> nn.Parameter:
        return nn.Parameter(self.take(name), requires_grad=False)


def load_layer(layer: DecoderLayer, ckpt: Checkpoint, prefix: str, config: ModelConfig, pack: bool) -> None:
    """One decoder layer's tensors (Hugging Face names under `prefix`) into `layer`."""
    attn, mlp = layer.self_attn, layer.mlp

    def weights(names: list[str], bias: bool):
        blocks = [ckpt.take(f"{prefix}{n}.weight") for n in names]
        return blocks, [ckpt.take(f"{prefix}{n}.bias") for n in names] if bias else None

    attn.qkv_proj.load(*weights([f"self_attn.{p}_proj" for p in "qkv"], config.qkv_bias), pack=pack)
    attn.o_proj.load(*weights(["self_attn.o_proj"], config.o_bias), pack=pack)
    mlp.gate_up_proj.load(*weights(["mlp.gate_proj", "mlp.up_proj"], config.mlp_bias), pack=pack)
    mlp.down_proj.load(*weights(["mlp.down_proj"], config.mlp_bias), pack=pack)
    layer.input_layernorm.weight = ckpt.parameter(f"{prefix}input_layernorm.weight")
    layer.post_attention_layernorm.weight = ckpt.parameter(f"{prefix}post_attention_layernorm.weight")


def load_model(path: str | Path, dtype: str | torch.dtype | None = None, quantization: str = "auto",
               load_format: str = "auto", device: torch.device | str = "cpu",
               shard: Sharding | None = None) -> LlamaForCausalLM:
    """The model of a directory, on `device`: its GGUF or safetensors weights (`load_format` auto),
    or random weights at its config's shape (dummy, `specserve.models.dummy`). Quantized blocks
    run our CPU kernels, their tiles in huge pages where the OS offers them (`huge_pages`):
    elsewhere a GGUF serves its exactly dequantized weights, bf16 by default.
    `shard`: only a tensor-parallel rank's share of the plain weights (`_load_shard`)."""
    model = _load_model(Path(path), dtype, quantization, load_format, torch.device(device), shard)
    move_tiles_to_huge_pages(model)
    return model


def _load_model(path: Path, dtype: str | torch.dtype | None, quantization: str, load_format: str,
                device: torch.device, shard: Sharding | None) -> LlamaForCausalLM:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format {load_format!r}: use one of {', '.join(LOAD_FORMATS)}")
    config = ModelConfig.from_dir(path)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: use one of {', '.join(QUANTIZATIONS)}")
    if shard is not None:
        return _load_shard(path, config, dtype, quantization, load_format, device, shard)
    if device.type != "cpu" and quantization in REQUANTIZE_BITS:
        raise ValueError(f"quantization {quantization} runs CPU kernels: on {device} use auto or none")
    if load_format == "dummy" and quantization in REQUANTIZE_BITS:
        model = load_model(path, torch.float32, "none", "dummy")
        _requantize(model, REQUANTIZE_BITS[quantization])
        return model
    if load_format == "dummy" or device.type != "cpu":
        # bf16 by default off the CPU; packing (a CPU bf16 layout) only where packing_available says
        dtype = _plain_dtype(dtype, device)
        pack = packing_available(dtype, device)
        if load_format == "dummy":
            return _assemble(config, Checkpoint(dummy_tensors(config, dtype, device), dtype, path, device), pack)
        if (path / GGUF_FILE).exists():
            return _build_gguf(path / GGUF_FILE, config, dtype, quantized=False, device=device)
        return _assemble(config, Checkpoint(_read_tensors(path, None), dtype, path, device), pack)
    if quantization in REQUANTIZE_BITS:
        if dtype not in (None, "auto") and parse_dtype(dtype) != torch.float32:
            raise ValueError(f"{quantization} blocks compute in float32, not {dtype}: leave the dtype unset")
        if (path / GGUF_FILE).exists():  # from the file's own blocks, the result cached as they are
            return load_gguf(path / GGUF_FILE, config, None, quantized=True, requantize=REQUANTIZE_BITS[quantization])
        model = load_model(path, torch.float32, "none")
        _requantize(model, REQUANTIZE_BITS[quantization])
        return model
    if (path / GGUF_FILE).exists():
        # Quantized blocks compute in fp32: a model asked for in another dtype gets plain weights.
        fp32 = dtype in (None, "auto") or parse_dtype(dtype) == torch.float32
        return load_gguf(path / GGUF_FILE, config, dtype, quantized=quantization == "auto" and fp32)
    dtype = parse_dtype(dtype)
    # Packed mode maps the checkpoint instead of reading it: its plain weights stay file-backed.
    pack = packing_available(dtype) and _checkpoint_dtypes(path) == {dtype}
    mappings: list[mmap.mmap] = []
    model = _assemble(config, Checkpoint(_read_tensors(path, mappings if pack else None), dtype, path), pack)
    for mapping in mappings:
        # Packing read every page; only large steps need them again. Never written, so the
        # kernel can simply drop them (they fault back in from the file on demand).
        mapping.madvise(mmap.MADV_DONTNEED)
    return model


def _plain_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Plain weights' dtype: as given, else bf16 off the CPU and the CPU's default on it."""
    return torch.bfloat16 if device.type != "cpu" and dtype in (None, "auto") else parse_dtype(dtype)


def _load_shard(path: Path, config: ModelConfig, dtype: str | torch.dtype | None, quantization: str,
                load_format: str, device: torch.device, shard: Sharding) -> LlamaForCausalLM:
    """A rank's share of plain weights (a GGUF's exactly dequantized): each projection's tensor is
    cut before it reaches the device, so a device holds its share only; a safetensors file is
    mapped, its pages read where the share lies."""
    if quantization not in ("auto", "none"):
        raise ValueError(f"tensor parallelism splits plain weights, not {quantization} blocks: use auto or none")
    dtype = _plain_dtype(dtype, device)
    pack = packing_available(dtype, device)
    mappings: list[mmap.mmap] = []
    if load_format == "dummy":
        tensors = dummy_tensors(config, dtype, device)
    elif (path / GGUF_FILE).exists():
        model = _build_gguf(path / GGUF_FILE, config, dtype, quantized=False, device=device, shard=shard)
        shard.finish(model)
        return model
    else:
        tensors = _read_tensors(path, mappings)
    model = _assemble(config, Checkpoint(tensors, dtype, path, device, shard.tensor), pack, shard.local(config))
    for mapping in mappings:
        mapping.madvise(mmap.MADV_DONTNEED)  # the other ranks' pages: this process never needs them
    shard.finish(model)
    return model


def _assemble(config: ModelConfig, ckpt: Checkpoint, pack: bool,
              local: ModelConfig | None = None) -> LlamaForCausalLM:
    """The model from a checkpoint's plain tensors, on the checkpoint's device; every tensor used.
    `local`: a tensor-parallel rank's sizes, which its layers are built at (`config` stays the whole's)."""
    model = _skeleton(config, local)
    for i, layer in enumerate(model.layers):
        load_layer(layer, ckpt, f"layers.{i}.", config, pack)
    model.embed_tokens.weight = ckpt.parameter("embed_tokens.weight")
    model.norm.weight = ckpt.parameter("norm.weight")
    if config.tie_word_embeddings:
        ckpt.tensors.pop("lm_head.weight", None)  # some exports store the tied copy too
        head = model.embed_tokens.weight.data
    else:
        head = ckpt.take("lm_head.weight")
    model.lm_head.load([head], None, pack=pack)
    if ckpt.tensors:
        raise ValueError(f"checkpoint in {ckpt.path} has tensors our {config.model_type} model does not use: "
                         f"{sorted(ckpt.tensors)[:5]}")
    model.init_rotary()
    return model.eval().requires_grad_(False)


def _skeleton(config: ModelConfig, local: ModelConfig | None) -> LlamaForCausalLM:
    """The model on the meta device, its layers at `local`'s sizes where given."""
    with torch.device("meta"):
        model = LlamaForCausalLM(local or config)
    model.config = config
    return model


def load_transformers(path: str | Path, dtype: torch.dtype):
    """The same weights in transformers (the peer benchmarks run, the tests' oracle): from the
    GGUF when the directory has one, as we serve it."""
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": GGUF_FILE} if (Path(path) / GGUF_FILE).exists() else {}
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **extra).eval()


def _requantize(model: LlamaForCausalLM, bits: int) -> None:
    for module in model.modules():
        if isinstance(module, Projection):
            module.requantize(bits)


def load_gguf(file: Path, config: ModelConfig, dtype: str | torch.dtype | None, quantized: bool,
              requantize: int | None = None) -> LlamaForCausalLM:
    """The model from a GGUF file: projections, LM head and embeddings in their own blocks
    (`quantized`; activations in fp32), or every weight dequantized exactly (`gguf`'s own fp32
    values; in bf16 only where the dtype, given or the CPU's default, says so). `requantize`: the
    projections requantized into blocks of that many bits (`Projection.requantize`), the
    embeddings kept in the file's blocks."""
    dtype = torch.float32 if quantized and dtype in (None, "auto") else parse_dtype(dtype)
    if quantized and dtype != torch.float32:
        raise ValueError(f"quantized GGUF weights compute in float32, not {dtype}: leave the dtype unset, or "
                         f"serve the dequantized weights with quantization none")
    if not quantized:
        return _build_gguf(file, config, dtype, quantized)
    cached = prepared.prepared_path(file, requantize)
    if cached.exists():
        try:
            return prepared.load(cached, config)
        except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:  # unreadable: prepare it again
            log.warning("prepared weights %s unusable (%s); preparing them again", cached, e)
    model = _build_gguf(file, config, dtype, quantized, tiles=requantize is None)
    if requantize is not None:
        _requantize(model, requantize)
    try:
        if prepared.save(model, cached):
            log.info("prepared weights saved to %s: later starts map them", cached)
    except OSError as e:  # a full or read-only cache only costs the next start its time
        log.warning("could not save prepared weights to %s: %s", cached, e)
    return model


def _build_gguf(file: Path, config: ModelConfig, dtype: torch.dtype, quantized: bool,
                tiles: bool = True, device: torch.device | str = "cpu",
                shard: Sharding | None = None) -> LlamaForCausalLM:
    device = torch.device(device)
    source = GGUFWeights(file, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                         llama_rope_order=config.model_type in ("llama", "mistral"))
    pack = not quantized and packing_available(dtype, device)
    cut = _whole if shard is None else shard.tensor  # a rank's share: of dequantized weights only

    def plain(name: str) -> torch.Tensor:
        return cut(name, source.take(name, quantized=False)).to(device=device, dtype=dtype)

    def projection(module, prefix: str, names: list[str], bias: bool) -> None:
        weights = [cut(f"{prefix}{n}.weight", source.take(f"{prefix}{n}.weight", quantized=quantized))
                   for n in names]
        biases = [plain(f"{prefix}{n}.bias") for n in names] if bias else None
        if all(isinstance(w, QuantizedRows) for w in weights):
            module.load_quantized(weights, biases, tiles)
        else:  # a format the kernel does not take: gguf dequantized it
            dense = [(w.dequantize() if isinstance(w, QuantizedRows) else w).to(device=device, dtype=dtype)
                     for w in weights]
            module.load(dense, biases, pack=pack)

    model = _skeleton(config, None if shard is None else shard.local(config))
    for i, layer in enumerate(model.layers):
        prefix = f"layers.{i}."
        projection(layer.self_attn.qkv_proj, prefix, [f"self_attn.{p}_proj" for p in "qkv"], config.qkv_bias)
        projection(layer.self_attn.o_proj, prefix, ["self_attn.o_proj"], config.o_bias)
        projection(layer.mlp.gate_up_proj, prefix, ["mlp.gate_proj", "mlp.up_proj"], config.mlp_bias)
        projection(layer.mlp.down_proj, prefix, ["mlp.down_proj"], config.mlp_bias)
        layer.input_layernorm.weight = nn.Parameter(plain(f"{prefix}input_layernorm.weight"), requires_grad=False)
        layer.post_attention_layernorm.weight = nn.Parameter(plain(f"{prefix}post_attention_layernorm.weight"),
                                                             requires_grad=False)
    model.norm.weight = nn.Parameter(plain("norm.weight"), requires_grad=False)
    embedding = source.take("embed_tokens.weight", quantized=quantized)
    if isinstance(embedding, QuantizedRows):
        model.embed_tokens = QuantizedEmbedding(embedding, dtype)
    else:
        model.embed_tokens.weight = nn.Parameter(embedding.to(device=device, dtype=dtype), requires_grad=False)
    if "lm_head.weight" in source.names():
        projection(model.lm_head, "", ["lm_head"], False)
    elif isinstance(embedding, QuantizedRows):  # tied: the head reads the embedding's own blocks
        model.lm_head.load_quantized([embedding], None, tiles)
    else:
        model.lm_head.load([model.embed_tokens.weight.data], None, pack=pack)
    if source.names():
        raise ValueError(f"{file} has tensors our {config.model_type} model does not use: {sorted(source.names())[:5]}")
    model.init_rotary()
    return model.eval().requires_grad_(False)
