"""The tensor index read from a GGUF header is what `gguf.GGUFReader` reads, whatever metadata
comes before it; a file that is not GGUF, or is cut short, is refused with a message."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from specserve.models.gguf_file import read_tensors
from tests.specserve.models.test_gguf import random_blocks


def write_file(path, alignment: int | None = None):
    """A GGUF with metadata of every value type (strings, arrays of strings and of arrays among
    them) before tensors of plain and block types."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("test.u8", 7)
    writer.add_int8("test.i8", -7)
    writer.add_uint16("test.u16", 700)
    writer.add_int16("test.i16", -700)
    writer.add_uint32("test.u32", 70000)
    writer.add_int32("test.i32", -70000)
    writer.add_float32("test.f32", 0.5)
    writer.add_uint64("test.u64", 2**40)
    writer.add_int64("test.i64", -(2**40))
    writer.add_float64("test.f64", 0.25)
    writer.add_bool("test.bool", True)
    writer.add_string("test.string", "ünïcode")
    writer.add_array("tokenizer.ggml.tokens", [f"token {i}" for i in range(3000)])
    writer.add_array("test.floats", [0.5] * 100)
    writer.add_key_value("test.nested", [[1, 2], [3]], GGUFValueType.ARRAY, sub_type=GGUFValueType.ARRAY)
    writer.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("half.weight", rng.standard_normal((3, 64)).astype(np.float16))
    for name, kind in (("q8.weight", "Q8_0"), ("q4k.weight", "Q4_K"), ("q6k.weight", "Q6_K")):
        writer.add_tensor(name, random_blocks(kind, 5, 512), raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_tensors_are_the_ones_gguf_reads(tmp_path, alignment):
    path = write_file(tmp_path / "model.gguf", alignment)
    theirs = GGUFReader(path).tensors
    ours = read_tensors(path)
    assert [t.name for t in ours] == [t.name for t in theirs]
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.tensor_type == reference.tensor_type, mine.name
        assert list(mine.shape) == reference.shape.tolist(), mine.name
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data.view(np.uint8), reference.data.view(np.uint8)), mine.name


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_tensors(path)


@pytest.mark.parametrize("keep", [100, 30000, -100])
def test_a_truncated_file_is_refused(tmp_path, keep):
    """Cut inside the metadata, inside its array of strings, or inside the last tensor."""
    whole = write_file(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:keep])
    with pytest.raises(ValueError, match="truncated"):
        read_tensors(cut)
