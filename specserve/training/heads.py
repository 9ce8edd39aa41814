"""The trainable forms of the drafter heads (`drafters.heads` runs them for drafting).

Training runs dense, right-padded batches of whole sequences with a causal mask: row i of a
sequence sees rows 0..i, as a head's row does over the paged cache when it drafts. The
target's pieces a head uses (embeddings, final norm, the LM head's rows for the draft
vocabulary) are frozen copies; only the head's own weights train.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.config import ModelConfig
from specserve.models.llama import DecoderLayer, LlamaForCausalLM
from specserve.models.rope import apply_rotary

KV = tuple[torch.Tensor, torch.Tensor]  # a layer's keys and values, [batch, heads, tokens, dim]


class TrainableLayer(nn.Module):
    """A Llama decoder layer over `[batch, tokens, hidden]`, causal, in Hugging Face names."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, heads, kv_heads, dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.heads, self.kv_heads, self.dim, self.eps = heads, kv_heads, dim, config.rms_norm_eps
        self.q_proj = nn.Linear(hidden, heads * dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=config.o_bias)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=config.mlp_bias)
        self.input_layernorm = nn.Parameter(torch.ones(hidden))
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> tuple[torch.Tensor, KV]:
        """The layer's output and its K/V. `past`: the K/V of the earlier passes of an unrolled
        run (see `unrolled_mask`); none: plain causal attention."""
        batch, tokens, _ = x.shape
        h = rms_norm(x, self.input_layernorm, self.eps)
        q = apply_rotary(self.q_proj(h).view(batch, tokens, self.heads, self.dim), cos, sin)
        k = apply_rotary(self.k_proj(h).view(batch, tokens, self.kv_heads, self.dim), cos, sin)
        v = self.v_proj(h).view(batch, tokens, self.kv_heads, self.dim)
        group = self.heads // self.kv_heads
        q, k, v = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(group, 1), v.transpose(1, 2).repeat_interleave(
            group, 1)
        if past:
            keys, values = torch.cat([pk for pk, _ in past] + [k], 2), torch.cat([pv for _, pv in past] + [v], 2)
            mask = unrolled_mask(tokens, len(past) + 1, x.device)
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.dim**-0.5)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.dim**-0.5)
        x = x + self.o_proj(attended.transpose(1, 2).reshape(batch, tokens, -1))
        h = rms_norm(x, self.post_attention_layernorm, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)), (k, v)

    def copy_from(self, layer: DecoderLayer) -> None:
        """Start from one of the target's layers (an early-exit head starts as layer K)."""
        projections = {("q_proj", "k_proj", "v_proj"): layer.self_attn.qkv_proj, ("o_proj",): layer.self_attn.o_proj,
                       ("gate_proj", "up_proj"): layer.mlp.gate_up_proj, ("down_proj",): layer.mlp.down_proj}
        weights, biases = {}, {}
        for names, projection in projections.items():  # plain or quantized (then its exact values)
            weights.update(zip(names, projection.dense_blocks(), strict=True))
            biases.update(zip(names, projection.dense_biases(), strict=True))
        with torch.no_grad():
            for name, weight in weights.items():
                module = getattr(self, name)
                module.weight.copy_(weight.float())
                if module.bias is not None and biases[name] is not None:
                    module.bias.copy_(biases[name].float())
            self.input_layernorm.copy_(layer.input_layernorm.weight.float())
            self.post_attention_layernorm.copy_(layer.post_attention_layernorm.weight.float())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Hugging Face names, as `drafters.heads.build_layer` loads them."""
        out = {"input_layernorm.weight": self.input_layernorm, "post_attention_layernorm.weight":
               self.post_attention_layernorm}
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.update(_linear(f"self_attn.{name}", getattr(self, name)))
        for name in ("gate_proj", "up_proj", "down_proj"):
            out.update(_linear(f"mlp.{name}", getattr(self, name)))
        return {k: v.detach() for k, v in out.items()}


def unrolled_mask(tokens: int, depth: int, device: torch.device) -> torch.Tensor:
    """What row i of pass `depth` (1-based) of an unrolled run attends to, over the keys of
    passes 1..depth side by side: a drafted node at depth d whose root is at position i - d + 1
    sees the committed rows up to its root (pass 1: true features) and its drafted ancestors,
    the rows i - d + e of passes e = 2..d (each fed the feature its parent predicted), itself
    last. So training unrolls the head exactly as drafting runs it (EAGLE-3's training-time test)."""
    rows = torch.arange(tokens, device=device)[:, None]
    cols = torch.arange(tokens, device=device)[None, :]
    blocks = [cols <= rows - depth + 1] + [cols == rows - (depth - e) for e in range(2, depth + 1)]
    return torch.cat(blocks, dim=1)


def _linear(prefix: str, module: nn.Linear) -> dict[str, torch.Tensor]:
    out = {f"{prefix}.weight": module.weight}
    if module.bias is not None:
        out[f"{prefix}.bias"] = module.bias
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class TrainableHead(nn.Module):
    """A head being trained: `kind` "feature" (fc + layer, predicts the next feature) or
    "early-exit" (the layer on the stream entering layer K, then the target's norm)."""

    def __init__(self, target: LlamaForCausalLM, kind: str, layer: int, vocab_ids: torch.Tensor):
        super().__init__()
        config = target.config
        self.kind, self.layer_index, self.eps = kind, layer, config.rms_norm_eps
        self.layer = TrainableLayer(config)
        if kind == "feature":
            self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        else:
            self.layer.copy_from(target.layers[layer])
        self.vocab_ids = vocab_ids
        # Frozen copies of what the head borrows from the target (fp32: the loss is computed in it).
        self.register_buffer("embed", target.embed_tokens.weight.detach().float(), persistent=False)
        self.register_buffer("norm", target.norm.weight.detach().float(), persistent=False)
        lm_head = target.lm_head.dense_blocks()[0][vocab_ids]
        self.register_buffer("lm_head", lm_head.detach().float(), persistent=False)
        self.rotary = target.rotary

    def rope(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(torch.arange(tokens, device=self.embed.device))
        return cos.float(), sin.float()

    def forward(self, tokens: torch.Tensor, inputs: torch.Tensor,
                past: Sequence[KV] = ()) -> tuple[torch.Tensor, torch.Tensor, KV]:
        """Draft logits over the draft vocabulary, the head's output states (`[B, T, .]`) and
        its K/V. `inputs`: the feature head's previous features (row i: f_{i-1}), or the
        early-exit head's stream entering layer K (row i: its own). `past`: the K/V of the
        earlier passes of an unrolled feature head (`unrolled_mask`)."""
        cos, sin = self.rope(tokens.shape[1])
        if self.kind == "feature":
            x = self.fc(torch.cat([inputs, F.embedding(tokens, self.embed)], dim=-1))
            out, kv = self.layer(x, cos, sin, past)
            return out @ self.lm_head.T, out, kv
        out, kv = self.layer(inputs, cos, sin)
        return rms_norm(out, self.norm, self.eps) @ self.lm_head.T, out, kv

    def teacher_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's logits over the draft vocabulary from its final-normed states."""
        return features @ self.lm_head.T

    @classmethod
    def from_tensors(cls, target: LlamaForCausalLM, kind: str, layer: int,
                     tensors: dict[str, torch.Tensor]) -> TrainableHead:
        """A saved head (`tensors()`'s layout) in trainable form: to score or train it further."""
        head = cls(target, kind, layer, tensors["vocab_ids"])
        own = {}
        for name, value in tensors.items():
            if name.startswith("layer."):  # layer.self_attn.q_proj.weight -> q_proj.weight
                parts = name.split(".")[1:]
                key = ".".join(parts[1:] if parts[0] in ("self_attn", "mlp") else parts)
                own[key.removesuffix(".weight") if key.endswith("layernorm.weight") else key] = value.float()
        head.layer.load_state_dict(own)
        if kind == "feature":
            head.fc.load_state_dict({"weight": tensors["fc.weight"].float(), "bias": tensors["fc.bias"].float()})
        return head

    def tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (`drafters.heads` layout), in the target's dtype-to-be (bf16)."""
        out = {f"layer.{k}": v for k, v in self.layer.tensors().items()}
        if self.kind == "feature":
            out.update({"fc.weight": self.fc.weight.detach(), "fc.bias": self.fc.bias.detach()})
        out = {k: v.to(torch.bfloat16).cpu() for k, v in out.items()}  # saved from the host
        out["vocab_ids"] = self.vocab_ids.to(torch.int64).cpu()
        return out
