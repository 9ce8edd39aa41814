"""A GGUF model's weights as the CPU kernels take them, saved once and memory-mapped at later starts.

Decoding K-quant blocks and repacking them in this CPU's tiles takes about 20 s for a 1.5B model.
The result depends only on the file, the kernels' build (CPU flags included) and the layouts, so
after the first load it is written to the cache (one safetensors file: tensors by module, the
layout in its metadata) and later starts map it instead. Nothing here is pickled: a cache file can
only ever hold tensors and field values.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
from dataclasses import fields
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from kernels import native
from specserve.models import gguf, linear
from specserve.models.config import ModelConfig
from specserve.models.gguf import BlockWeight, QuantizedRows, SuperBlockWeight
from specserve.models.linear import Projection, QuantizedEmbedding
from specserve.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)
SCHEMA = 1  # bump when what is saved changes meaning
WEIGHT_CLASSES = {cls.__name__: cls for cls in (BlockWeight, SuperBlockWeight)}


def prepared_path(file: Path, requantize: int | None = None) -> Path:
    """Where the prepared weights of GGUF `file` live (`requantize`: its projections requantized to
    that many bits): keyed by the file, the kernels and the layouts."""
    from specserve.pull import cache_dir

    stat = file.stat()
    digest = hashlib.sha256()
    for part in (str(stat.st_size), str(stat.st_mtime_ns), native.build_key(), str(SCHEMA), str(requantize),
                 Path(gguf.__file__).read_text(), Path(linear.__file__).read_text()):
        digest.update(part.encode())
    return cache_dir() / "prepared" / f"{_file_prefix(file, requantize)}{digest.hexdigest()[:16]}.safetensors"


def _file_prefix(file: Path, requantize: int | None) -> str:
    """The part of the name that says which GGUF, and which requantization of it: every version of
    those prepared weights shares it (a requantized copy never replaces the file's own)."""
    variant = "" if requantize is None else f"int{requantize}-"
    return f"{file.parent.name}-{hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:8]}-{variant}"


def save(model: LlamaForCausalLM, path: Path) -> bool:
    """Write the model's prepared weights to `path` (older versions of them for the same GGUF are
    removed); False (nothing written) for a model with dense projections or embeddings."""
    tensors: dict[str, torch.Tensor] = {}
    saved: dict[int, str] = {}  # weight object -> its key (a tied head shares the embedding's)

    def weight(key: str, w: QuantizedRows) -> dict:
        if id(w) in saved:
            return {"same_as": saved[id(w)]}
        saved[id(w)] = key
        plain = {f.name: getattr(w, f.name) for f in fields(w) if not isinstance(getattr(w, f.name), torch.Tensor)}
        own = w._tensors()
        tensors.update({f"{key}.{name}": t.contiguous() for name, t in own.items()})
        tiles = w.tiles()
        tensors.update({f"{key}.tiles.{j}": t.contiguous() for j, t in enumerate(tiles or ())})
        return {"class": type(w).__name__, "fields": plain, "tensors": list(own),
                "tiles": None if tiles is None else len(tiles)}

    if not isinstance(model.embed_tokens, QuantizedEmbedding):
        return False
    layout: dict = {"embedding": weight("embed_tokens", model.embed_tokens.blocks), "projections": {}, "plain": []}
    for name, module in model.named_modules():
        if isinstance(module, Projection):
            if not module.quantized:
                return False
            layout["projections"][name] = [weight(f"{name}.{i}", w) for i, w in enumerate(module.quantized)]
            if module.fused_bias is not None:
                tensors[f"{name}.bias"] = module.fused_bias.contiguous()
    for name, parameter in model.named_parameters():
        tensors[name] = parameter.data.contiguous()
        layout["plain"].append(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    save_file(tensors, str(partial), metadata={"specserve": json.dumps(layout)})
    partial.replace(path)  # whole or absent: a crash mid-write leaves no half file under the real name
    # The same GGUF (and requantization) prepared for other kernels or layouts: never read again.
    # (The glob alone would also match the file's requantized copies, whose prefix extends this one.)
    for stale in path.parent.glob(f"{_file_prefix_of(path)}*.safetensors"):
        if stale != path and _file_prefix_of(stale) == _file_prefix_of(path):
            stale.unlink(missing_ok=True)
    return True


def _file_prefix_of(path: Path) -> str:
    return path.name[: -len("0123456789abcdef.safetensors")]


def load(path: Path, config: ModelConfig) -> LlamaForCausalLM:
    """The model from prepared weights, every tensor a view of the memory-mapped file."""
    from specserve.models.loader import _header, _mapped_tensors

    header_len, _ = _header(path)
    with open(path, "rb") as f:
        f.seek(8)
        layout = json.loads(json.loads(f.read(header_len))["__metadata__"]["specserve"])
    mappings: list[mmap.mmap] = []
    tensors = _mapped_tensors(path, mappings)
    objects: dict[str, QuantizedRows] = {}

    def weight(key: str, entry: dict) -> QuantizedRows:
        if "same_as" in entry:
            return objects[entry["same_as"]]
        w = WEIGHT_CLASSES[entry["class"]](**{n: tensors[f"{key}.{n}"] for n in entry["tensors"]}, **entry["fields"])
        tiles = entry["tiles"]
        w.adopt_tiles(None if tiles is None else tuple(tensors[f"{key}.tiles.{j}"] for j in range(tiles)))
        objects[key] = w
        return w

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.embed_tokens = QuantizedEmbedding(weight("embed_tokens", layout["embedding"]), torch.float32)
    for name, entries in layout["projections"].items():
        model.get_submodule(name).restore_quantized([weight(f"{name}.{i}", e) for i, e in enumerate(entries)],
                                                     tensors.get(f"{name}.bias"))
    for name in layout["plain"]:
        module_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(module_name), attribute, nn.Parameter(tensors[name], requires_grad=False))
    model._prepared_mappings = mappings  # the views need their maps alive as long as the model
    model.init_rotary()
    return model.eval().requires_grad_(False)
