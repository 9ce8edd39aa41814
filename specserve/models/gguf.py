"""A GGUF file's weights as they are stored: quantized blocks, kept quantized.

Every block format our models ship (Q4_0, Q4_1, Q4_K, Q6_K, Q8_0) is one affine code per weight
with a scale and a minimum per group of 16 or 32 inputs, `w = scale * q + min`, so they all become
one `BlockWeight` that `kernels.native.block_matmul` multiplies directly. Scales and minimums are the
file's own (fp16 products, exact in fp32); `BlockWeight.dequantize` gives `gguf`'s own
dequantization bit for bit. Other formats (and F32/F16/BF16 tensors) are dequantized by `gguf`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

QK_K = 256  # elements per K-quant super-block


@dataclass
class BlockWeight:
    """A [rows, cols] weight as codes (4-bit: two per byte, 8-bit: one per byte) plus fp32 scale
    and minimum per group of `group` columns. 4-bit codes keep GGUF's Q4_0 layout per 32 columns:
    byte j holds column j in its low nibble and column j + 16 in its high nibble."""

    codes: torch.Tensor  # uint8 [rows, cols / 2] (bits 4) or [rows, cols] (bits 6, 8)
    scale: torch.Tensor  # float32 [rows, cols / group]
    min: torch.Tensor  # float32 [rows, cols / group]
    bits: int
    group: int
    source_type: str  # the GGUF type it came from, for logs ("Q4_1")
    zero_point: int = 0  # symmetric formats (Q4_0, Q6_K, Q8_0): w = scale * (q - zero_point), min = -zero_point * scale

    @property
    def shape(self) -> tuple[int, int]:
        return self.scale.shape[0], self.scale.shape[1] * self.group

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.min))

    def values(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """The integer codes of `rows`, one per weight, as uint8 [len(rows), cols]."""
        codes = self.codes[rows]
        if self.bits != 4:
            return codes
        spans = codes.view(codes.shape[0], -1, 16)
        return torch.cat([spans & 0x0F, spans >> 4], dim=2).view(codes.shape[0], -1)

    def dequantize(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """fp32 weights of `rows`: `scale * q + min` rounded once, exactly as `gguf` computes them."""
        q = self.values(rows).double()
        scale = self.scale[rows].double().repeat_interleave(self.group, dim=1)
        if self.zero_point:  # as gguf multiplies: zeros keep the scale's sign
            return (scale * (q - self.zero_point)).float()
        min_ = self.min[rows].double().repeat_interleave(self.group, dim=1)
        return torch.addcmul(min_, q, scale).float()  # exact in fp64, then one rounding

    @classmethod
    def quantize(cls, weight: torch.Tensor, bits: int, group: int = 32) -> BlockWeight:
        """A plain [rows, cols] weight in codes of `bits` per group of `group` columns, for a
        checkpoint that has no blocks of its own (`--quantization int8|int4`): int8 symmetric as
        Q8_0 (scale = absmax / 127), int4 affine as Q4_1 (scale = (max - min) / 15), fp32 scales."""
        if bits not in (4, 8) or weight.dim() != 2 or weight.shape[1] % 32 or group != 32:
            raise ValueError(f"quantize: a 2-D weight with a multiple of 32 columns, 4 or 8 bits, groups of 32; "
                             f"got {tuple(weight.shape)}, {bits} bits, groups of {group}")
        w = weight.float().reshape(weight.shape[0], -1, group)
        if bits == 8:
            scale = w.abs().amax(dim=2) / 127
            safe = torch.where(scale > 0, scale, 1.0)
            codes = (torch.round(w / safe.unsqueeze(2)).clamp(-127, 127) + 128).to(torch.uint8)
            return cls(codes.reshape(weight.shape[0], -1).contiguous(), scale.contiguous(), (-128 * scale).contiguous(),
                       8, group, "int8", zero_point=128)
        low, high = w.amin(dim=2), w.amax(dim=2)
        scale = (high - low) / 15
        safe = torch.where(scale > 0, scale, 1.0)
        q = torch.round((w - low.unsqueeze(2)) / safe.unsqueeze(2)).clamp(0, 15).to(torch.uint8)
        codes = torch.from_numpy(pack_nibbles(q.reshape(weight.shape[0], -1).numpy()))
        return cls(codes.contiguous(), scale.contiguous(), low.contiguous(), 4, group, "int4")

    def permute_rows(self, order: torch.Tensor) -> BlockWeight:
        return BlockWeight(self.codes[order].contiguous(), self.scale[order].contiguous(),
                           self.min[order].contiguous(), self.bits, self.group, self.source_type, self.zero_point)

    @staticmethod
    def stack(parts: list[BlockWeight]) -> BlockWeight | None:
        """Parts of one layout stacked by rows (fused q/k/v, gate/up); None when layouts differ."""
        first = parts[0]
        layout = lambda p: (p.bits, p.group, p.shape[1], p.zero_point)  # noqa: E731
        if any(layout(p) != layout(first) for p in parts):
            return None
        if len(parts) == 1:
            return first
        return BlockWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                           torch.cat([p.min for p in parts]), first.bits, first.group,
                           "+".join(sorted({p.source_type for p in parts})), first.zero_point)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 values < 16, [rows, cols] -> [rows, cols / 2] in the 32-column span layout."""
    spans = q.reshape(q.shape[0], -1, 2, 16)
    return (spans[:, :, 0, :] | (spans[:, :, 1, :] << 4)).reshape(q.shape[0], -1)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _blocks(data: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    return np.asarray(data, dtype=np.uint8).reshape(rows, -1, block_bytes)


def _q4_0(data, rows):
    b = _blocks(data, rows, 18)
    d = _f16(b[..., 0:2])[..., 0]
    return b[..., 2:].reshape(rows, -1), d, -8 * d, 4, 32, 8


def _q4_1(data, rows):
    b = _blocks(data, rows, 20)
    d, m = _f16(b[..., 0:2])[..., 0], _f16(b[..., 2:4])[..., 0]
    return b[..., 4:].reshape(rows, -1), d, m, 4, 32, 0


def _q8_0(data, rows):
    b = _blocks(data, rows, 34)
    d = _f16(b[..., 0:2])[..., 0]
    codes = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes.reshape(rows, -1), d, -128 * d, 8, 32, 128


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's twelve bytes of packed 6-bit sub-block scales and minimums (as gguf unpacks them)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k(data, rows):
    b = _blocks(data, rows, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [rows, blocks, 1]
    sc, mn = _k_scales(b[..., 4:16])
    qs = b[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    q = (qs & 0x0F).reshape(rows, -1)  # 64 columns per 32 bytes: low nibbles, then high
    return pack_nibbles(q), (d * sc).reshape(rows, -1), (-(dmin * mn)).reshape(rows, -1), 4, 32, 0


def _q6_k(data, rows):
    b = _blocks(data, rows, 210)
    ql, qh = b[..., :128], b[..., 128:192]
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    low = (ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F
    high = (qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03
    q = low.reshape(rows, -1, 2, 4, 32) | (high.reshape(rows, -1, 2, 4, 32) << 4)
    scale = (d * sc).reshape(rows, -1)
    return q.reshape(rows, -1), scale, -32 * scale, 6, 16, 32


DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


def decode_blocks(raw: np.ndarray, type_name: str, rows: int) -> BlockWeight | None:
    """`rows` rows of raw GGUF blocks of type `type_name` as a BlockWeight; None for other types."""
    decode = DECODERS.get(type_name)
    if decode is None:
        return None
    codes, scale, min_, bits, group, zero_point = decode(raw, rows)
    as_tensor = lambda a, dtype: torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))  # noqa: E731
    return BlockWeight(as_tensor(codes, np.uint8), as_tensor(scale, np.float32), as_tensor(min_, np.float32),
                       bits, group, type_name, zero_point)


def block_weight(tensor) -> BlockWeight | None:
    """A 2-D `gguf.ReaderTensor` as a BlockWeight, or None when its type is not one of DECODERS."""
    return decode_blocks(tensor.data, tensor.tensor_type.name, int(tensor.shape[-1]))  # dims innermost first


def dequantized(tensor) -> torch.Tensor:
    """Any GGUF tensor as fp32, by `gguf`'s own dequantization, in Hugging Face's [out, in] shape."""
    from gguf.quants import dequantize

    shape = [int(d) for d in reversed(tensor.shape)]
    return torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), np.float32)).view(shape)  # a copy


# GGUF names -> our (Hugging Face) names; per layer `blk.{i}.` -> `layers.{i}.`
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, index, part = base.split(".", 2)
        return f"layers.{index}.{LAYER_NAMES[part]}.{kind}" if part in LAYER_NAMES else None
    return f"{GLOBAL_NAMES[base]}.{kind}" if base in GLOBAL_NAMES else None


def unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves each Llama q/k head's rotary halves; this row order undoes it."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


class GGUFWeights:
    """The tensors of a GGUF file under our names: `take(name)` gives a BlockWeight where the
    format allows, else fp32; Llama q/k rows back in Hugging Face order."""

    def __init__(self, path: Path, *, num_heads: int, num_kv_heads: int, llama_rope_order: bool):
        from gguf import GGUFReader

        self.path = path
        self.reader = GGUFReader(path)
        self.tensors = {}
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            if name is not None:
                self.tensors[name] = tensor
        self.heads = {"q_proj": num_heads, "k_proj": num_kv_heads}
        self.llama_rope_order = llama_rope_order

    def names(self) -> set[str]:
        return set(self.tensors)

    def _order(self, name: str, rows: int) -> torch.Tensor | None:
        part = name.split(".")[-2]
        if self.llama_rope_order and part in self.heads:
            return unpermute_order(rows, self.heads[part])
        return None

    def take(self, name: str, *, quantized: bool) -> BlockWeight | torch.Tensor:
        tensor = self.tensors.pop(name)
        weight = block_weight(tensor) if quantized and len(tensor.shape) == 2 else None
        if weight is None:
            weight = dequantized(tensor)
        order = self._order(name, weight.shape[0])
        if order is None:
            return weight
        return weight.permute_rows(order) if isinstance(weight, BlockWeight) else weight[order].contiguous()
