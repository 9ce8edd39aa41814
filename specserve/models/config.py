"""Model configuration: the subset of a Hugging Face `config.json` our Llama family needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# model_type -> (q/k/v bias, o bias) defaults; Llama-style configs say so via `attention_bias`.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)  # factor, low_freq_factor, ...


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the dtype the weights were saved in
    sliding_window: int | None = None

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly (a sliding window would change attention past it)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; specserve serves the Llama family: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (SwiGLU with silu only)")
        num_heads = cfg["num_attention_heads"]
        if model_type == "qwen2":  # Qwen2 always has q/k/v bias and never an o_proj bias
            qkv_bias, o_bias = True, False
        else:  # Llama's `attention_bias` covers q, k, v and o alike
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope=_rope_config(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            sliding_window=sliding,
        )


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings from either transformers 5 (`rope_parameters`) or 4 (`rope_scaling`)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096))
    return RopeConfig(theta=float(theta), rope_type=rope_type, params=params)
