"""Our Llama-family model (Llama, Mistral, Qwen2, SmolLM) over the paged KV cache.

Every forward runs a flat, unpadded batch of token trees (see `specserve.tree`): prefill,
decode and verification are the same call. Q/K/V and gate/up are fused into single
matmuls for small steps because on a CPU each small linear costs tens of microseconds of
overhead (see `specserve.models.linear`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops
from kernels.metadata import AttentionMetadata
from specserve.kv_cache import KVCache
from specserve.models.config import ModelConfig
from specserve.models.linear import Projection
from specserve.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    """Normalises in fp32 and casts back before the weight, exactly as transformers does."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Projection(config.hidden_size, [self.q_size, self.kv_size, self.kv_size])
        self.o_proj = Projection(self.q_size, [config.hidden_size])

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache.layer(self.layer_index)
        out = ops.tree_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Projection(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = Projection(config.intermediate_size, [config.hidden_size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [len(logits_indices), vocab] fp32
    hidden: torch.Tensor | None  # [T, hidden] final-normed hidden states, when asked for


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Projection(config.hidden_size, [config.vocab_size])
        self.rotary: RotaryEmbedding | None = None  # built after weights are loaded (not on meta)
        self.output_ids: torch.Tensor | None = None  # the tokens the LM head scores (None: all)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def init_rotary(self) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, self.dtype)

    def restrict_output_vocab(self, token_ids: torch.Tensor) -> None:
        """Score only `token_ids` (the rest get -inf logits): a draft model's LM head over its
        most frequent tokens costs a fraction of the full one (FR-Spec). For drafts only."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).unique()
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self.config.vocab_size:
            raise ValueError(f"output vocabulary must be token ids in [0, {self.config.vocab_size})")
        head = Projection(self.config.hidden_size, [ids.numel()])
        head.load([self.lm_head.blocks[0][ids]], None, pack=self.lm_head.packed is not None)
        self.lm_head, self.output_ids = head, ids

    def quantize_int8(self) -> None:
        """Every projection, LM head included, runs small steps in int8 (see `Projection.quantize_int8`).
        For draft models only: the outputs change a little."""
        for module in self.modules():
            if isinstance(module, Projection):
                module.quantize_int8()

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        logits_indices: torch.Tensor | None = None,
        return_hidden: bool = False,
        num_layers: int | None = None,
    ) -> ForwardOutput:
        """Run the step's trees; logits only for `logits_indices` (all tokens when None).

        `num_layers` stops after the first layers and applies the final norm and LM head there
        (early exit: the target's own cheap draft, reusing its cache for those layers)."""
        if self.rotary is None:
            raise RuntimeError("call init_rotary() after loading weights")
        cos, sin = self.rotary(meta.positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers[:num_layers]:
            x = layer(x, cos, sin, kv_cache, meta)
        if logits_indices is not None and not return_hidden:
            x = x[logits_indices]  # normalise only the rows whose logits we need
            logits_indices = None
        hidden = self.norm(x)
        selected = hidden if logits_indices is None else hidden[logits_indices]
        logits = self.lm_head(selected).float()
        if self.output_ids is not None:
            full = logits.new_full((logits.shape[0], self.config.vocab_size), -math.inf)
            logits = full.index_copy_(1, self.output_ids, logits)
        return ForwardOutput(logits=logits, hidden=hidden if return_hidden else None)
