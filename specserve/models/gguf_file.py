"""A GGUF file's tensor index, read straight from its header.

`gguf.GGUFReader` parses every metadata value into numpy views first, one view per array element:
a Qwen2.5 file's tokenizer (151k tokens, types and merges) takes it ~30 s on a 2-core host before
any weight is read. The weights need none of that, so metadata is stepped over here and only the
tensor infos are read; the tensors themselves are views of one read-only memory map, shaped as
`GGUFReader` shapes them (its `dequantize` and our block decoders take them unchanged).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# metadata value types (the GGUF spec's gguf_metadata_value_type) of a fixed size: struct format
FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# element types gguf stores unblocked, read as numpy arrays of their own type (as GGUFReader does)
PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
         GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
         GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as the file stores it: innermost dimension first
    data: np.ndarray  # plain types in their own dtype, blocks as uint8 rows of bytes; outermost first


class _Cursor:
    """Little-endian reads at a moving offset of a buffer, each checked against its end."""

    def __init__(self, buffer: memoryview, path: Path):
        self.buffer, self.path, self.offset = buffer, path, 0

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize("<" + fmt)
        if self.offset + size > len(self.buffer):
            raise ValueError(f"{self.path} ends inside its GGUF header (at byte {self.offset}): the file is truncated")
        values = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += size
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        raw = self.buffer[self.offset:self.offset + length]
        self.offset += length
        return bytes(raw).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        (length,) = self.unpack("Q")
        self.offset += length

    def value(self, kind: int, keep: bool) -> object:
        """A metadata value of type `kind`: read where `keep`, else stepped over (None)."""
        if kind in FIXED:
            if keep:
                return self.unpack(FIXED[kind])[0]
            self.offset += struct.calcsize("<" + FIXED[kind])
            return None
        if kind == STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if kind == ARRAY:
            element, count = self.unpack("IQ")
            if element in FIXED:  # one jump over the whole array
                self.offset += count * struct.calcsize("<" + FIXED[element])
            else:
                for _ in range(count):
                    self.value(element, keep=False)
            return None
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {kind} at byte {self.offset}")


def read_tensors(path: str | Path) -> list[GGUFTensor]:
    """The tensors of GGUF file `path` (version 2 or 3, little-endian), in the file's order."""
    path = Path(path)
    with path.open("rb") as f:
        mapped = np.memmap(f, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped), path)
    if bytes(mapped[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it does not start with {MAGIC!r})")
    cursor.offset = 4
    version, tensor_count, kv_count = cursor.unpack("IQQ")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = cursor.string()
        (kind,) = cursor.unpack("I")
        value = cursor.value(kind, keep=key == "general.alignment")
        if value is not None:
            alignment = int(value)
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        (dims,) = cursor.unpack("I")
        shape = cursor.unpack("Q" * dims)
        raw_type, offset = cursor.unpack("IQ")
        infos.append((name, shape, GGMLQuantizationType(raw_type), offset))
    start = -(-cursor.offset // alignment) * alignment
    return [GGUFTensor(name, kind, shape, _data(mapped, start + offset, shape, kind, path))
            for name, shape, kind, offset in infos]


def _data(mapped: np.memmap, offset: int, shape: tuple[int, ...], kind: GGMLQuantizationType,
          path: Path) -> np.ndarray:
    count = int(np.prod(shape))
    outer_first = tuple(reversed(shape))
    block_size, type_size = GGML_QUANT_SIZES[kind]
    size = count * type_size // block_size
    if offset + size > len(mapped):
        raise ValueError(f"{path} is truncated: a {kind.name} tensor of shape {shape} runs past its end")
    raw = mapped[offset:offset + size]
    if kind in PLAIN:
        return raw.view(PLAIN[kind]).reshape(outer_first)
    return raw.reshape(quant_shape_to_byte_shape(outer_first, kind))
