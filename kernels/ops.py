"""The attention ops the model calls, dispatched to the Triton kernels, our C++ CPU kernel or
the torch reference.

Triton runs on CUDA tensors, the C++ kernel (`kernels.cpu_attention`) on fp32, bf16 and int8 CPU
caches and the reference on other CPU tensors, unless the environment variable
`SPECSERVE_ATTENTION=triton|cpu|reference` forces one. Forcing `triton` on CPU runs
the real kernels through Triton's interpreter, so the whole engine can run on the kernels
anywhere (slowly). The variable is read on every call, so tests can flip it.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch

from kernels import reference
from kernels.metadata import AttentionMetadata

BACKENDS = ("triton", "cpu", "reference")
_TRITON_MODULE = "kernels.tree_attention"


def backend(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """Which implementation runs for tensors of `dtype` on `device`."""
    forced = os.environ.get("SPECSERVE_ATTENTION", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"SPECSERVE_ATTENTION={forced!r}: use one of {', '.join(BACKENDS)} (or leave it unset)")
        return forced
    if device.type == "cuda":
        return "triton"
    return "cpu" if dtype in (torch.float32, torch.bfloat16, torch.int8) else "reference"


def _implementation(device: torch.device, dtype: torch.dtype) -> ModuleType:
    chosen = backend(device, dtype)
    if chosen == "reference":
        return reference
    if chosen == "cpu":
        return importlib.import_module("kernels.cpu_attention")
    if device.type == "cpu" and _TRITON_MODULE not in sys.modules:
        # The interpreter is chosen when the kernels are defined, i.e. when their module is imported.
        os.environ["TRITON_INTERPRET"] = "1"
    module = importlib.import_module(_TRITON_MODULE)
    if device.type == "cpu" and not module.INTERPRET:
        raise RuntimeError(
            "the Triton kernels were compiled for the GPU in this process, so they cannot run CPU tensors: "
            "set TRITON_INTERPRET=1 before starting, or SPECSERVE_ATTENTION=reference"
        )
    return module


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    _implementation(k_cache.device, k_cache.dtype).write_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_tree_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    return _implementation(q.device, k_cache.dtype).paged_tree_attention(q, k_cache, v_cache, meta, scale)


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The one attention entry point: write the step's K/V, then attend under the tree mask."""
    implementation = _implementation(q.device, k_cache.dtype)
    implementation.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return implementation.paged_tree_attention(q, k_cache, v_cache, meta, scale)


def compact_kv(cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Move accepted K or V rows down to contiguous slots (see `metadata.compaction_slots`)."""
    _implementation(cache.device, cache.dtype).compact_kv(cache, src_slots, dst_slots)
