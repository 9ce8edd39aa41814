"""Random weights at a real model's shape (`--load-format dummy`): speed measured where the
weights cannot be fetched, from nothing but a `config.json` (`configs/models/` ships Llama-2-7B,
Llama-2-13B, Llama-3.1-8B and a 160M Llama draft).

The weights are drawn as Hugging Face initializes a Llama (normal, std `initializer_range`; norms
one) from a fixed seed, on the device that serves them: the same model on every start, so a
continuation recorded once (the replay drafter's) holds on the next run, and a 13B model in bf16
never passes through host memory on a GPU.
"""

from __future__ import annotations

import torch

from specserve.models.config import ModelConfig

DEFAULT_SEED = 0
INITIALIZER_RANGE = 0.02  # transformers' LlamaConfig default


def dummy_tensors(config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                  seed: int = DEFAULT_SEED) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint of `config`'s shape holds, by its Hugging Face name (no `model.` prefix)."""
    device = torch.device(device)
    # (meta tensors, which only count sizes, take no generator)
    generator = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        # Drawn in fp32 and rounded once: the same values in every dtype, up to that rounding.
        out = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, INITIALIZER_RANGE,
                                                                               generator=generator)
        return out.to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=device)

    hidden, inter, head = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_heads * head, config.num_kv_heads * head
    tensors = {"embed_tokens.weight": normal(config.vocab_size, hidden), "norm.weight": ones(hidden)}
    for i in range(config.num_layers):
        prefix = f"layers.{i}."
        projections = {  # name: (shape, has a bias)
            "self_attn.q_proj": ((q_out, hidden), config.qkv_bias),
            "self_attn.k_proj": ((kv_out, hidden), config.qkv_bias),
            "self_attn.v_proj": ((kv_out, hidden), config.qkv_bias),
            "self_attn.o_proj": ((hidden, q_out), config.o_bias),
            "mlp.gate_proj": ((inter, hidden), config.mlp_bias), "mlp.up_proj": ((inter, hidden), config.mlp_bias),
            "mlp.down_proj": ((hidden, inter), config.mlp_bias)}
        for name, (shape, has_bias) in projections.items():
            tensors[f"{prefix}{name}.weight"] = normal(*shape)
            if has_bias:
                tensors[f"{prefix}{name}.bias"] = zeros(shape[0])
        tensors[f"{prefix}input_layernorm.weight"] = ones(hidden)
        tensors[f"{prefix}post_attention_layernorm.weight"] = ones(hidden)
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(config.vocab_size, hidden)
    return tensors
