"""Attention kernels for specserve: one tree-attention entry point over a paged KV cache.

Kept deliberately light: `kernels` is also the import name of Hugging Face's kernel-hub
package, which transformers probes (and may import). No heavy work at import time and no
`__version__` here, so transformers never mistakes this package for that one.

The attention ops (`tree_attention`, `write_kv`, `paged_tree_attention`, `compact_kv`) live
in `kernels.ops`, which dispatches to the Triton kernels (`kernels/tree_attention.py`) or
the torch reference (`kernels/reference.py`). Call them through `kernels.ops`: the package
attribute `kernels.tree_attention` is the Triton module once that has been imported.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "AttentionMetadata": "kernels.metadata",
    "compaction_slots": "kernels.metadata",
    "slots_for": "kernels.metadata",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Lazy exports: importing `kernels` must not import torch.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
