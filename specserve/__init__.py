"""specserve: speculative-decoding-first LLM serving.

Imports stay lazy so `specserve --help` and `import specserve` do not pay for torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "TokenTree": "specserve.tree",
    "pull": "specserve.pull",
    "resolve_model": "specserve.pull",
    "load_model": "specserve.models.loader",
    "LLM": "specserve.llm",
    "SamplingParams": "specserve.sampling",
    "EngineConfig": "specserve.config",
    "LLMEngine": "specserve.engine",
    "AsyncEngine": "specserve.async_engine",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specserve' has no attribute {name!r}")
