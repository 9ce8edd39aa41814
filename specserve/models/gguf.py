"""A GGUF file's weights as they are stored: quantized blocks, kept quantized.

Two layouts cover every block format our models ship:

* `BlockWeight` (Q4_0, Q4_1, Q5_0, Q8_0): one affine code per weight with a scale and a minimum
  per group of 32 inputs, `w = scale * q + min`, multiplied by `kernels.native.block_matmul`;
* `SuperBlockWeight` (Q4_K, Q6_K): the file's super-blocks of 256 inputs with integer sub-block
  scales (and minimums) and fp16 d (and dmin), multiplied by `kernels.native.kquant_matmul`.

Scales and minimums are the file's own (exact in fp32); `dequantize` gives `gguf`'s own
dequantization bit for bit. Other formats (and F32/F16/BF16 tensors) are dequantized by `gguf`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from kernels import native
from specserve.models.gguf_file import GGUFTensor, read_tensors

QK_K = 256  # elements per K-quant super-block
# kernel builds with vector code for the tiled layouts (+amx: where Linux lets the process use AMX tiles)
TILED_ISAS = ("avx512-vnni+amx", "avx512-vnni", "avx2+vnni", "avx2")


class QuantizedRows:
    """What both layouts share: every tensor field is indexed by the weight's rows; `tiles()`, the
    weights repacked for this CPU's fastest kernel (or None), kept beside them once made."""

    def tiles(self) -> tuple[torch.Tensor, ...] | None:
        """The weights in this CPU's layout for the fastest kernel (made once, kept beside them), or
        None where the stored layout is the one the kernel takes."""
        if "_tiles" not in self.__dict__:
            self.__dict__["_tiles"] = self._repack(native.isa())
        return self.__dict__["_tiles"]

    def adopt_tiles(self, tiles: tuple[torch.Tensor, ...] | None) -> None:
        """Tiles made earlier for this CPU (prepared weights), instead of making them again."""
        self.__dict__["_tiles"] = tiles
        self.__dict__.pop("_kernel", None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` in fp32 (activations quantized per `activation_block` inputs)."""
        return self.kernel()(x)

    def kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`matmul` as one call of this CPU's kernel with the weight's tensors bound (made once)."""
        if "_kernel" not in self.__dict__:
            kernel, args = self.kernel_call()
            self.__dict__["_kernel"] = lambda x: kernel(x, *args)
        return self.__dict__["_kernel"]

    def kernel_call(self) -> tuple[Callable[..., torch.Tensor], tuple]:
        """This CPU's kernel op and the arguments after `x` it takes for this weight (tensors, then ints)."""
        raise NotImplementedError

    def _repack(self, isa: str) -> tuple[torch.Tensor, ...] | None:
        raise NotImplementedError

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    @property
    def nbytes(self) -> int:
        return _size(self._tensors().values())

    @property
    def read_bytes(self) -> int:
        """What a matmul reads: the tiles where this CPU has them, else the stored fields."""
        tiles = self.tiles()
        return self.nbytes if tiles is None else _size(tiles)

    def permute_rows(self, order: torch.Tensor):
        return replace(self, **{name: t[order].contiguous() for name, t in self._tensors().items()})

    def _layout(self) -> tuple:
        plain = tuple(getattr(self, f.name) for f in fields(self)
                      if f.name != "source_type" and not isinstance(getattr(self, f.name), torch.Tensor))
        return type(self), self.shape[1], plain

    @staticmethod
    def stack(parts: list) -> QuantizedRows | None:
        """Parts of one layout stacked by rows (fused q/k/v, gate/up); None when layouts differ."""
        first = parts[0]
        if any(p._layout() != first._layout() for p in parts):
            return None
        if len(parts) == 1:
            return first
        own = [p._tensors() for p in parts]
        tensors = {name: torch.cat([t[name] for t in own]) for name in own[0]}
        return replace(first, **tensors, source_type="+".join(sorted({p.source_type for p in parts})))


@dataclass
class BlockWeight(QuantizedRows):
    """A [rows, cols] weight as codes (4-bit: two per byte; 5- to 8-bit: one per byte) plus fp32
    scale and minimum per group of `group` columns. 4-bit codes keep GGUF's Q4_0 layout per 32
    columns: byte j holds column j in its low nibble and column j + 16 in its high nibble."""

    codes: torch.Tensor  # uint8 [rows, cols / 2] (bits 4) or [rows, cols] (bits 5, 6, 8)
    scale: torch.Tensor  # float32 [rows, cols / group]
    min: torch.Tensor  # float32 [rows, cols / group]
    bits: int
    group: int
    source_type: str  # the GGUF type it came from, for logs ("Q4_1")
    zero_point: int = 0  # symmetric formats (Q4_0, Q5_0, Q8_0): w = scale * (q - zero_point), min = -zero_point * scale

    @property
    def shape(self) -> tuple[int, int]:
        return self.scale.shape[0], self.scale.shape[1] * self.group

    def kernel_call(self) -> tuple[Callable[..., torch.Tensor], tuple]:
        """`kernels/cpu/block_matmul.cpp` (activations quantized per 32 inputs), over the tiles where
        this CPU has them (the same arithmetic per output, other instructions)."""
        tiles = self.tiles()
        if tiles is not None:
            return native.op("tiled_matmul"), (*tiles, tiled_bits(self.bits))
        return native.op("block_matmul"), (self.codes, self.scale, self.min, self.bits, self.group)

    activation_block = 32  # inputs per activation scale

    def _repack(self, isa: str) -> tuple[torch.Tensor, ...] | None:
        """`native.tiled_matmul`'s tiles on a CPU with AVX-512 VNNI or AVX2 (groups of 32, rows a multiple
        of 16, scales and minimums exact in fp16: a GGUF's always are)."""
        fits = self.group == 32 and self.shape[0] % 16 == 0
        if isa in TILED_ISAS and fits and _exact_in_fp16(self.scale, self.min):
            return tile_blocks(self.values(), self.scale, self.min, self.bits)
        return None

    def values(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """The integer codes of `rows`, one per weight, as uint8 [len(rows), cols]."""
        codes = self.codes[rows]
        if self.bits != 4:
            return codes
        spans = codes.view(codes.shape[0], -1, 16)
        return torch.cat([spans & 0x0F, spans >> 4], dim=2).view(codes.shape[0], -1)

    def dequantize(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """fp32 weights of `rows`: `scale * q + min` rounded once, exactly as `gguf` computes them
        (an fp16 scale times a code of at most 8 bits is exact in fp32: only the sum rounds)."""
        q = self.values(rows).float()
        q = q.view(q.shape[0], -1, self.group)
        scale = self.scale[rows].unsqueeze(2)
        if self.zero_point:  # as gguf multiplies: zeros keep the scale's sign
            return q.sub_(self.zero_point).mul_(scale).flatten(1)
        return q.mul_(scale).add_(self.min[rows].unsqueeze(2)).flatten(1)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bits: int, group: int = 32) -> BlockWeight:
        """A plain [rows, cols] weight in codes of `bits` per group of `group` columns, for a
        checkpoint that has no blocks of its own (`--quantization int8|int4`): int8 symmetric as
        Q8_0 (scale = absmax / 127), int4 affine as Q4_1 (scale = (max - min) / 15), scales and
        minimums rounded to fp16 as in those formats (what the tiled kernel takes)."""
        if bits not in (4, 8) or weight.dim() != 2 or weight.shape[1] % 32 or group != 32:
            raise ValueError(f"quantize: a 2-D weight with a multiple of 32 columns, 4 or 8 bits, groups of 32; "
                             f"got {tuple(weight.shape)}, {bits} bits, groups of {group}")
        w = weight.float().reshape(weight.shape[0], -1, group)
        fp16 = lambda t: t.half().float()  # noqa: E731
        if bits == 8:
            scale = fp16(w.abs().amax(dim=2) / 127)
            safe = torch.where(scale > 0, scale, 1.0)
            codes = (torch.round(w / safe.unsqueeze(2)).clamp(-127, 127) + 128).to(torch.uint8)
            return cls(codes.reshape(weight.shape[0], -1).contiguous(), scale.contiguous(), (-128 * scale).contiguous(),
                       8, group, "int8", zero_point=128)
        low = fp16(w.amin(dim=2))
        scale = fp16((w.amax(dim=2) - low) / 15)
        safe = torch.where(scale > 0, scale, 1.0)
        q = torch.round((w - low.unsqueeze(2)) / safe.unsqueeze(2)).clamp(0, 15).to(torch.uint8)
        codes = torch.from_numpy(pack_nibbles(q.reshape(weight.shape[0], -1).numpy()))
        return cls(codes.contiguous(), scale.contiguous(), low.contiguous(), 4, group, "int4")


@dataclass
class SuperBlockWeight(QuantizedRows):
    """A [rows, cols] weight in K-quant super-blocks of 256 columns, the file's bytes rearranged:
    Q4_K (`bits` 4: w = d * sc * q - dmin * m, 6-bit sc and m per 32 columns) and Q6_K (`bits` 6:
    w = d * sc * (q - 32), int8 sc per 16 columns), d and dmin per super-block. Low 4 bits of the
    codes per 128 columns in 64 bytes (byte j: column j low, column j + 64 high); Q6_K's top two
    bits per 128 columns in 32 bytes (byte j: columns j, j + 32, j + 64, j + 96, two bits each)."""

    codes: torch.Tensor  # uint8 [rows, cols / 2]
    high: torch.Tensor  # uint8 [rows, cols / 4] (Q6_K) or [rows, 0]
    sub_scale: torch.Tensor  # uint8 [rows, cols / 32] (Q4_K) or int8 [rows, cols / 16] (Q6_K)
    sub_min: torch.Tensor  # uint8 [rows, cols / 32] (Q4_K) or [rows, 0]
    d: torch.Tensor  # float32 [rows, cols / 256]
    dmin: torch.Tensor  # float32 [rows, cols / 256] (Q4_K) or [rows, 0]
    bits: int
    source_type: str

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * QK_K

    @property
    def group(self) -> int:
        return 32 if self.bits == 4 else 16

    def kernel_call(self) -> tuple[Callable[..., torch.Tensor], tuple]:
        """`kernels/cpu/kquant_matmul.cpp` (activations quantized per 256 inputs), over the tiles where
        this CPU has them; the groups' kernel where it has only the expanded groups (see _repack)."""
        tiles = self.tiles()
        if tiles is None:
            return native.op("kquant_matmul"), (self.codes, self.high, self.sub_scale, self.sub_min, self.d, self.dmin,
                                                self.bits)
        if len(tiles) == 3:
            return native.op("block_matmul"), (*tiles, self.bits, self.group)
        return native.op("kquant_tiled_matmul"), (*tiles, self.bits)

    @property
    def activation_block(self) -> int:
        """Inputs per activation scale: 256 in the K-quant kernels (llama.cpp's Q8_K), 32 where this
        CPU runs the groups' kernel instead."""
        tiles = self.tiles()
        return 32 if tiles is not None and len(tiles) == 3 else 256

    def _repack(self, isa: str) -> tuple[torch.Tensor, ...] | None:
        """`native.kquant_tiled_matmul`'s tiles on a CPU with AVX-512 VNNI or AVX2 (rows a multiple of
        16); else the stored layout where `native.kquant_matmul` has vector code (AVX-512 VNNI);
        elsewhere codes, scale and minimum per sub-block for `native.block_matmul`, whose AVX2 path
        the untiled K-quant kernel lacks (1.3x / 1.8x the bytes of Q4_K / Q6_K, but vectorized)."""
        if isa in TILED_ISAS and self.shape[0] % 16 == 0:
            return tile_super_blocks(self)
        if isa.startswith("avx512-vnni"):
            return None
        per_sub = QK_K // self.group
        scale = self.d.repeat_interleave(per_sub, dim=1) * self.sub_scale.float()  # exact: fp16 x 6-8 bits
        if self.bits == 6:
            return self.values().contiguous(), scale.contiguous(), (-32 * scale).contiguous()
        min_ = -(self.dmin.repeat_interleave(per_sub, dim=1) * self.sub_min.float())
        return torch.from_numpy(pack_nibbles(self.values().numpy())), scale.contiguous(), min_.contiguous()

    def values(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """The integer codes of `rows` (0-15 or 0-63), one per weight, as uint8 [len(rows), cols]."""
        codes = self.codes[rows]
        chunks = codes.view(codes.shape[0], -1, 64)
        q = torch.cat([chunks & 0x0F, chunks >> 4], dim=2)
        if self.bits == 6:
            high = self.high[rows].view(codes.shape[0], -1, 32)
            q |= torch.cat([(high >> (2 * t)) & 0x03 for t in range(4)], dim=2) << 4
        return q.view(codes.shape[0], -1)

    def dequantize(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """fp32 weights of `rows`, exactly as `gguf` computes them: fp16 d times an 8-bit sub-block
        scale, times a code of at most 6 bits, is exact in fp32 (under 24 significant bits), so
        only Q4_K's subtraction of the minimum rounds."""
        q = self.values(rows).float()
        q = q.view(q.shape[0], -1, self.group)
        per_sub = QK_K // self.group
        scale = (self.d[rows].repeat_interleave(per_sub, dim=1) * self.sub_scale[rows].float()).unsqueeze(2)
        if self.bits == 6:
            return q.sub_(32).mul_(scale).flatten(1)
        min_ = self.dmin[rows].repeat_interleave(per_sub, dim=1) * self.sub_min[rows].float()
        return q.mul_(scale).sub_(min_.unsqueeze(2)).flatten(1)


def pack_nibbles(q: np.ndarray, span: int = 32) -> np.ndarray:
    """uint8 values < 16, [rows, cols] -> [rows, cols / 2]: per `span` columns, byte j holds column
    j in its low nibble and column j + span / 2 in its high nibble."""
    spans = q.reshape(q.shape[0], -1, 2, span // 2)
    return (spans[:, :, 0, :] | (spans[:, :, 1, :] << 4)).reshape(q.shape[0], -1)


def _size(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def tiled_bits(bits: int) -> int:
    """The code width of `tiled_matmul`'s layout for codes of `bits`: 4, 5, or bytes (8)."""
    return bits if bits in (4, 5) else 8


def _exact_in_fp16(*tensors: torch.Tensor) -> bool:
    return all(torch.equal(t.half().float(), t) for t in tensors)


def tile_blocks(codes: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor,
                bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [rows, cols] and per-32 scale and minimum in the tiled layout of `tiled_matmul`: per 16
    rows and 32 columns, lane o of vector k holds row o's codes of columns 4k..4k+3 (4- and 5-bit:
    vectors 0-3, columns 16 + 4k.. in the high nibbles; 5-bit: then eight 64-bit masks of the fifth
    bits, bit 4o + i of mask k for lane byte 4o + i), then the 16 rows' scales and minimums (fp16)."""
    rows, cols = codes.shape
    v = codes.view(rows // 16, 16, cols // 32, 8, 4).permute(0, 2, 3, 1, 4)  # tile, group, k, row, byte
    width = tiled_bits(bits)
    parts = [v if width == 8 else (v[:, :, :4] & 0x0F) | ((v[:, :, 4:] & 0x0F) << 4)]
    if width == 5:  # bit j of byte b in mask k: lane byte 8b + j
        fifth = ((v >> 4) & 1).reshape(rows // 16, cols // 32, 8, 8, 8)
        parts.append((fifth << torch.arange(8, dtype=torch.uint8)).sum(dim=4, dtype=torch.uint8))
    codes_tiled = torch.cat([p.reshape(rows // 16, cols // 32, -1) for p in parts], dim=2)
    per_tile = lambda t: t.view(rows // 16, 16, cols // 32).transpose(1, 2).half().contiguous()  # noqa: E731
    return codes_tiled.contiguous(), per_tile(scale), per_tile(min_)


def tile_super_blocks(w: SuperBlockWeight) -> tuple[torch.Tensor, ...]:
    """A K-quant weight in the tiled layout of `kquant_tiled_matmul` (see kernels/cpu/kquant_matmul.cpp):
    codes [rows / 16, blocks, 2048 | 3072], sub-scales (and Q4_K's minimums) [rows / 16, blocks, 256],
    d and dmin [rows / 16, blocks, 16]."""
    rows, cols = w.shape
    tiles, blocks = rows // 16, cols // QK_K
    q = w.values().view(tiles, 16, blocks, 8, 8, 4).permute(0, 2, 3, 4, 1, 5)  # tile, block, 32 inputs, k, row, byte
    parts = [q[:, :, :, :4] & 0x0F | (q[:, :, :, 4:] & 0x0F) << 4]
    if w.bits == 6:
        top, weights = q >> 4, torch.tensor([1, 4, 16, 64], dtype=torch.uint8).view(4, 1, 1)  # bits 2k..2k+1
        parts += [(top[:, :, :, 4 * h:4 * h + 4] * weights).sum(dim=3, dtype=torch.uint8) for h in range(2)]
    codes = torch.cat([p.reshape(tiles, blocks, 8, -1) for p in parts], dim=3).reshape(tiles, blocks, -1)
    per_tile = lambda t: t.view(tiles, 16, blocks, -1).permute(0, 2, 3, 1)  # noqa: E731  tile, block, sub, row
    if w.bits == 4:
        mins = w.sub_min.view(tiles, 16, blocks, 4, 2).permute(0, 2, 3, 1, 4)  # tile, block, pair, row, 2
        scales = torch.cat([per_tile(w.sub_scale).reshape(tiles, blocks, -1), mins.reshape(tiles, blocks, -1)], dim=2)
    else:
        scales = per_tile(w.sub_scale.view(torch.uint8)).reshape(tiles, blocks, -1)
    d = w.d.view(tiles, 16, blocks).transpose(1, 2).contiguous()
    dmin = w.dmin.view(tiles, 16, blocks).transpose(1, 2).contiguous() if w.bits == 4 else w.dmin
    return codes.contiguous(), scales.contiguous(), d, dmin


def pack_high_bits(high: np.ndarray) -> np.ndarray:
    """uint8 values < 4, [rows, cols] -> [rows, cols / 4]: per 128 columns, byte j holds columns
    j, j + 32, j + 64 and j + 96 in bits 0-1, 2-3, 4-5 and 6-7."""
    parts = high.reshape(high.shape[0], -1, 4, 32)
    packed = parts[:, :, 0] | (parts[:, :, 1] << 2) | (parts[:, :, 2] << 4) | (parts[:, :, 3] << 6)
    return packed.reshape(high.shape[0], -1)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _blocks(data: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    return np.asarray(data, dtype=np.uint8).reshape(rows, -1, block_bytes)


def _tensor(a: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))


def _grouped(rows, codes, d, min_, bits, zero_point, type_name) -> BlockWeight:
    return BlockWeight(_tensor(codes.reshape(rows, -1), np.uint8), _tensor(d, np.float32), _tensor(min_, np.float32),
                       bits, 32, type_name, zero_point)


def _q4_0(data, rows):
    b = _blocks(data, rows, 18)
    d = _f16(b[..., 0:2])[..., 0]
    return _grouped(rows, b[..., 2:], d, -8 * d, 4, 8, "Q4_0")


def _q4_1(data, rows):
    b = _blocks(data, rows, 20)
    d, m = _f16(b[..., 0:2])[..., 0], _f16(b[..., 2:4])[..., 0]
    return _grouped(rows, b[..., 4:], d, m, 4, 0, "Q4_1")


def _q5_0(data, rows):
    b = _blocks(data, rows, 22)
    d = _f16(b[..., 0:2])[..., 0]
    high = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little")  # little-endian bit j: column j's fifth bit
    low = np.concatenate([b[..., 6:] & 0x0F, b[..., 6:] >> 4], axis=-1)  # columns 0-15, then 16-31
    return _grouped(rows, low | (high << 4), d, -16 * d, 5, 16, "Q5_0")


def _q8_0(data, rows):
    b = _blocks(data, rows, 34)
    d = _f16(b[..., 0:2])[..., 0]
    codes = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return _grouped(rows, codes, d, -128 * d, 8, 128, "Q8_0")


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's twelve bytes of packed 6-bit sub-block scales and minimums (as gguf unpacks them)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k(data, rows):
    b = _blocks(data, rows, 144)
    d, dmin = _f16(b[..., 0:2])[..., 0], _f16(b[..., 2:4])[..., 0]  # [rows, blocks]
    sc, mn = _k_scales(b[..., 4:16])
    qs = b[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    q = (qs & 0x0F).reshape(rows, -1)  # 64 columns per 32 bytes: low nibbles, then high
    empty = np.zeros((rows, 0), np.uint8)
    return SuperBlockWeight(_tensor(pack_nibbles(q, 128), np.uint8), _tensor(empty, np.uint8),
                            _tensor(sc.reshape(rows, -1), np.uint8), _tensor(mn.reshape(rows, -1), np.uint8),
                            _tensor(d, np.float32), _tensor(dmin, np.float32), 4, "Q4_K")


def _q6_k(data, rows):
    b = _blocks(data, rows, 210)
    ql, qh = b[..., :128], b[..., 128:192]
    sc = b[..., 192:208].view(np.int8)
    d = _f16(b[..., 208:210])[..., 0]
    low = (ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F
    high = (qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03
    q = (low.reshape(rows, -1, 2, 4, 32) | (high.reshape(rows, -1, 2, 4, 32) << 4)).reshape(rows, -1)
    return SuperBlockWeight(_tensor(pack_nibbles(q & 0x0F, 128), np.uint8), _tensor(pack_high_bits(q >> 4), np.uint8),
                            _tensor(sc.reshape(rows, -1), np.int8), _tensor(np.zeros((rows, 0)), np.uint8),
                            _tensor(d, np.float32), _tensor(np.zeros((rows, 0)), np.float32), 6, "Q6_K")


DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


def decode_blocks(raw: np.ndarray, type_name: str, rows: int) -> BlockWeight | SuperBlockWeight | None:
    """`rows` rows of raw GGUF blocks of type `type_name` in our layout; None for other types."""
    decode = DECODERS.get(type_name)
    return decode(raw, rows) if decode is not None else None


def block_weight(tensor: GGUFTensor) -> BlockWeight | SuperBlockWeight | None:
    """A 2-D GGUF tensor as a BlockWeight, or None when its type is not one of DECODERS."""
    return decode_blocks(tensor.data, tensor.tensor_type.name, int(tensor.shape[-1]))  # dims innermost first


def dequantized(tensor: GGUFTensor) -> torch.Tensor:
    """Any GGUF tensor as fp32, in Hugging Face's [out, in] shape: `gguf`'s own dequantization,
    bit for bit (through our decoders where they take the format: 1.6x faster on Qwen2.5-1.5B)."""
    from gguf.quants import dequantize

    shape = [int(d) for d in reversed(tensor.shape)]
    blocks = block_weight(tensor) if len(shape) == 2 else None
    if blocks is not None:
        return blocks.dequantize()
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
        self.path = path
        self.tensors = {}
        for tensor in read_tensors(path):
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

    def take(self, name: str, *, quantized: bool) -> BlockWeight | SuperBlockWeight | torch.Tensor:
        tensor = self.tensors.pop(name)
        weight = block_weight(tensor) if quantized and len(tensor.shape) == 2 else None
        if weight is None:
            weight = dequantized(tensor)
        order = self._order(name, weight.shape[0])
        if order is None:
            return weight
        return weight.permute_rows(order) if isinstance(weight, QuantizedRows) else weight[order].contiguous()
