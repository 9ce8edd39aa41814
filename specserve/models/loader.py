"""Load a Hugging Face-style directory (config.json + safetensors) into our model.

The model is built on the meta device (no memory, no init cost), then the checkpoint's
tensors are fused (q/k/v, gate/up) and assigned in place.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specserve.models.config import ModelConfig
from specserve.models.llama import LlamaForCausalLM


def default_dtype() -> torch.dtype:
    """bf16 where the CPU has native bf16 (AVX512-BF16 / AMX), else fp32."""
    try:
        return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    except (AttributeError, RuntimeError):
        return torch.float32


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype:
    if name is None or name == "auto":
        return default_dtype()
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; use one of: float32, bfloat16, float16")
    return table[name]


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}: is it a Hugging Face model directory?")
    return files


def _read_tensors(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name.removeprefix("model.")] = f.get_tensor(name).to(dtype)
    return tensors


def _fuse(config: ModelConfig, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a transformers checkpoint to our module names, fusing q/k/v and gate/up."""
    state: dict[str, torch.Tensor] = {}
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        for suffix in ("weight", "bias") if config.qkv_bias else ("weight",):
            parts = [raw.pop(f"{src}self_attn.{p}_proj.{suffix}") for p in "qkv"]
            state[f"{dst}self_attn.qkv_proj.{suffix}"] = torch.cat(parts, 0)
        for suffix in ("weight", "bias") if config.mlp_bias else ("weight",):
            parts = [raw.pop(f"{src}mlp.{p}_proj.{suffix}") for p in ("gate", "up")]
            state[f"{dst}mlp.gate_up_proj.{suffix}"] = torch.cat(parts, 0)
    for name in list(raw):
        if "rotary_emb" in name:  # old checkpoints stored inv_freq; we recompute it
            raw.pop(name)
    state.update(raw)  # o_proj, down_proj, norms, embeddings, lm_head keep their names
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def load_model(path: str | Path, dtype: str | torch.dtype | None = None) -> LlamaForCausalLM:
    path = Path(path)
    config = ModelConfig.from_dir(path)
    dtype = parse_dtype(dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = _fuse(config, _read_tensors(path, dtype))
    if config.tie_word_embeddings:
        del model.lm_head.weight
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint in {path} does not match the {config.model_type} layout: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.init_rotary()
    return model.eval().requires_grad_(False)
