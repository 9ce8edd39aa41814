"""Attention kernels for specserve: one tree-attention entry point over a paged KV cache.

Kept deliberately light: `kernels` is also the import name of Hugging Face's kernel-hub
package, which transformers probes (and may import). No heavy work at import time and no
`__version__` here, so transformers never mistakes this package for that one.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "AttentionMetadata": "kernels.metadata",
    "compaction_slots": "kernels.metadata",
    "slots_for": "kernels.metadata",
    "tree_attention": "kernels.reference",
    "write_kv": "kernels.reference",
    "paged_tree_attention": "kernels.reference",
    "compact_kv": "kernels.reference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Lazy exports: importing `kernels` must not import torch.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
