"""Our Llama-family model (Llama, Mistral, Qwen2, SmolLM) over the paged KV cache.

Every forward runs a flat, unpadded batch of token trees (see `specserve.tree`): prefill,
decode and verification are the same call. Q/K/V and gate/up are fused into single
matmuls for small steps because on a CPU each small linear costs tens of microseconds of
overhead (see `specserve.models.linear`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native, ops
from kernels.metadata import AttentionMetadata
from specserve.kv_cache import KVCache
from specserve.models.config import ModelConfig
from specserve.models.gguf import BlockWeight, SuperBlockWeight
from specserve.models.linear import DirectModule, Projection, QuantizedEmbedding, weights_generation
from specserve.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(DirectModule):
    """Normalises in fp32 and casts back before the weight, exactly as transformers does."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native(x):
            return native.rms_norm(x, self.weight, self.eps)  # one pass; each row alone
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x + delta, norm(x + delta))` (delta None: x, norm(x)): the residual add fused into the
        norm, one op instead of two (a small model's decode is mostly per-op costs)."""
        if delta is None:
            return x, self.forward(x)
        if self._native(x):
            return native.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self.forward(x)

    def _native(self, x: torch.Tensor) -> bool:
        return x.dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2


class Attention(DirectModule):
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
        qkv = self.qkv_proj(x)
        k_cache, v_cache = kv_cache.layer(self.layer_index)
        if ops.backend(qkv.device, k_cache.dtype) == "cpu" and qkv.dtype == torch.float32:
            # one C++ pass: rotary q and k, k and v into their slots (same bits as below)
            q = native.rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, self.num_heads,
                                     self.num_kv_heads)
            out = ops.paged_tree_attention(q, k_cache, v_cache, meta, self.scale)
            return self.o_proj(out.reshape(tokens, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = ops.tree_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(DirectModule):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Projection(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = Projection(config.intermediate_size, [config.hidden_size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.down_proj.quantized and gate_up.dtype == torch.float32 and gate_up.device.type == "cpu":
            # one pass, as the decoder stack does (torch's bits on AVX2; plain weights keep torch's
            # ops, the path held equal to transformers)
            return self.down_proj(native.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(DirectModule):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream enters as `x + delta` and leaves as the sum of the two returned
        tensors: each residual add is done by the norm after it (`RMSNorm.add_forward`)."""
        x, h = self.input_layernorm.add_forward(x, delta)
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, cos, sin, kv_cache, meta))
        return x, self.mlp(h)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [len(logits_indices), vocab] fp32
    # Hidden states asked for by `hidden_at`, each [T, hidden]: key k < num_layers is the residual
    # stream after the first k layers (what layer k takes in); key num_layers is the final-normed
    # state the LM head reads. Drafter heads train on, and draft from, these.
    hidden: dict[int, torch.Tensor]


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
        # (weights generation, stack, whether it scores too: `_build_stack`)
        self._stack: tuple[int, torch.ScriptObject | None, bool] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def weight_format(self) -> str:
        """What the projections hold: "GGUF blocks Q4_1, Q8_0" or "plain float32" (for logs and /metrics)."""
        kinds = sorted({w.source_type for m in self.modules() if isinstance(m, Projection) for w in m.quantized})
        if not kinds:
            return f"plain {str(self.dtype).removeprefix('torch.')}"
        origin = "requantized" if set(kinds) <= {"int8", "int4"} else "GGUF"
        return f"{origin} blocks {', '.join(kinds)}"

    def init_rotary(self) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, self.dtype,
                                      self.norm.weight.device)
        self._stack = None  # a stack binds the tables

    def restrict_output_vocab(self, token_ids: torch.Tensor) -> None:
        """Score only `token_ids` (the rest get -inf logits): a draft model's LM head over its
        most frequent tokens costs a fraction of the full one (FR-Spec). For drafts only."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).unique()
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self.config.vocab_size:
            raise ValueError(f"output vocabulary must be token ids in [0, {self.config.vocab_size})")
        self.lm_head, self.output_ids = self.lm_head.select_rows(ids), ids

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
        hidden_at: Sequence[int] = (),
        num_layers: int | None = None,
    ) -> ForwardOutput:
        """Run the step's trees; logits only for `logits_indices` (all tokens when None), and
        the hidden states `hidden_at` names (see `ForwardOutput.hidden`).

        `num_layers` stops after the first layers and applies the final norm and LM head there
        (early exit: the target's own cheap draft, reusing its cache for those layers)."""
        total = self.config.num_layers
        final_only = tuple(hidden_at) in ((), (total,))  # nothing, or the final-normed states (a feature head's)
        if final_only and num_layers in (None, total) and self.output_ids is None:
            stack = self._decoder_stack(input_ids.device, self.dtype, kv_cache, whole_step=True)
            if stack is not None:
                args = (input_ids, meta.positions, kv_cache.k, kv_cache.v, meta.slot_mapping, meta.query_start_loc,
                        meta.context_lens, meta.block_tables, meta.ancestor_mask, self.layers[0].self_attn.scale,
                        logits_indices)
                if not hidden_at:
                    return ForwardOutput(logits=stack.logits(*args), hidden={})
                logits, normed = stack.logits_and_normed(*args)
                return ForwardOutput(logits=logits, hidden={total: normed})
        normed, hidden = self.final_hidden(input_ids, meta, kv_cache, logits_indices, hidden_at, num_layers)
        return ForwardOutput(logits=self.score(normed), hidden=hidden)

    def final_hidden(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        rows: torch.Tensor | None = None,
        hidden_at: Sequence[int] = (),
        num_layers: int | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`forward` up to the LM head: the final-normed states of token `rows` (all: None), and
        the hidden states `hidden_at` names."""
        if self.rotary is None:
            raise RuntimeError("call init_rotary() after loading weights")
        total = self.config.num_layers
        if any(not 0 <= k <= total for k in hidden_at):
            raise ValueError(f"hidden_at {tuple(hidden_at)}: layer boundaries run from 0 to {total}")
        hidden: dict[int, torch.Tensor] = {}
        x, delta = self._layers(input_ids, meta, kv_cache, num_layers, hidden_at, hidden)
        final = total in hidden_at and (num_layers is None or num_layers == total)
        if rows is not None and not final:
            x, delta = x[rows], delta if delta is None else delta[rows]  # only the rows asked for
            rows = None
        _, normed = self.norm.add_forward(x, delta)
        if final:
            hidden[total] = normed
        return (normed if rows is None else normed[rows]), hidden

    def run_layers(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                   num_layers: int | None = None, hidden_at: Sequence[int] = (),
                   hidden: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Embed and run the first `num_layers` layers (all: None); the residual stream out.
        The states entering the layers `hidden_at` names go into `hidden`."""
        x, delta = self._layers(input_ids, meta, kv_cache, num_layers, hidden_at, hidden)
        return x if delta is None else x + delta

    def _layers(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache, num_layers: int | None,
                hidden_at: Sequence[int],
                hidden: dict[int, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run_layers` with the last residual add left to the caller: the stream out is x + delta."""
        cos, sin = self.rotary(meta.positions)
        x, delta = self.embed_tokens(input_ids), None
        count = len(range(self.config.num_layers)[:num_layers])  # slicing the ModuleList builds a new one
        stack = self._decoder_stack(x.device, x.dtype, kv_cache)
        start = 0
        for index in sorted(k for k in set(hidden_at) if k < count) if hidden is not None else ():
            x, delta = self._run(stack, x, delta, cos, sin, kv_cache, meta, start, index)
            if delta is not None:
                x, delta = x + delta, None
            hidden[index] = x
            start = index
        return self._run(stack, x, delta, cos, sin, kv_cache, meta, start, count)

    def _run(self, stack: torch.ScriptObject | None, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
             sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, begin: int,
             end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers [begin, end): in one C++ call where the stack serves this step, else module by module."""
        if stack is None:
            for layer in self.layers[begin:end]:
                x, delta = layer(x, delta, cos, sin, kv_cache, meta)
            return x, delta
        return stack.forward(x, delta, cos, sin, kv_cache.k, kv_cache.v, meta.slot_mapping, meta.query_start_loc,
                             meta.context_lens, meta.block_tables, meta.ancestor_mask,
                             self.layers[0].self_attn.scale, begin, end)

    def _decoder_stack(self, device: torch.device, dtype: torch.dtype, kv_cache: KVCache,
                       whole_step: bool = False) -> torch.ScriptObject | None:
        """The layers as one C++ call (`native.decoder_stack`: the same ops, a fraction of the
        per-op cost), where the layers would take exactly its path: fp32 states on the CPU through
        our attention kernel, every projection in quantized blocks. None elsewhere, or with
        SPECSERVE_DECODER_STACK=0 (module by module, the same bits). `whole_step`: only a stack
        that also holds the embedding, final norm and LM head (`DecoderStack.logits`), which
        SPECSERVE_DECODER_STACK=layers leaves to the modules (the same bits)."""
        setting = os.environ.get("SPECSERVE_DECODER_STACK")
        if (device.type != "cpu" or dtype != torch.float32
                or kv_cache.k.dtype not in (torch.float32, torch.bfloat16, torch.int8)
                or ops.backend(device, torch.float32) != "cpu" or setting == "0"):
            return None
        generation = weights_generation()
        if self._stack is None or self._stack[0] != generation:
            self._stack = (generation, *self._build_stack())
        if whole_step and (not self._stack[2] or setting == "layers"):
            return None
        return self._stack[1]

    def _build_stack(self) -> tuple[torch.ScriptObject | None, bool]:
        """The stack over the layers' weights (None: a projection is not in quantized blocks), and
        whether it also holds the embedding, final norm and LM head, which `forward` then leaves to
        it too (an LM head in plain weights, or a bf16 embedding, stay here)."""
        stack = build_decoder_stack(list(self.layers), self.config)
        return (stack, self._bind_ends(stack)) if stack is not None else (None, False)

    def _bind_ends(self, stack: torch.ScriptObject) -> bool:
        """Bind the embedding, final norm and LM head to the stack where it can run them."""
        head = self.lm_head
        if not bind_embedding(stack, self.embed_tokens):
            return False
        if not head.quantized or head.collective is not None or self.rotary is None:
            return False
        stack.set_rotary(self.rotary.cos, self.rotary.sin)
        stack.set_final_norm(self.norm.weight.detach())
        for op, tensors, ints in _kernel_calls(head):
            stack.add_head_part(op, tensors, ints)
        if head.fused_bias is not None:
            stack.set_head_bias(head.fused_bias)
        return True

    def score(self, normed: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the whole vocabulary for final-normed hidden states."""
        logits = self.lm_head(normed).float()
        if self.output_ids is not None:
            full = logits.new_full((logits.shape[0], self.config.vocab_size), -math.inf)
            logits = full.index_copy_(1, self.output_ids, logits)
        return logits


def bind_embedding(stack: torch.ScriptObject, embedding: nn.Module) -> bool:
    """Give the stack the model's token embeddings (`DecoderStack.embed`), in the form they are
    kept: a float32 table, or GGUF blocks or super-blocks; False for any other."""
    quantized = isinstance(embedding, QuantizedEmbedding) and embedding.dtype == torch.float32
    if quantized and isinstance(embedding.blocks, BlockWeight):
        w = embedding.blocks
        stack.set_embedding_blocks(w.codes, w.scale, w.min, w.bits, w.group, w.zero_point)
    elif quantized and isinstance(embedding.blocks, SuperBlockWeight):
        w = embedding.blocks
        stack.set_embedding_superblocks(w.codes, w.high, w.sub_scale, w.sub_min, w.d, w.dmin, w.bits)
    elif isinstance(embedding, nn.Embedding) and embedding.weight.dtype == torch.float32:
        stack.set_embedding_table(embedding.weight.detach())
    else:
        return False
    return True


def build_decoder_stack(layers: Sequence[DecoderLayer], config: ModelConfig) -> torch.ScriptObject | None:
    """`layers` as one `native.decoder_stack` (their K/V: layers 0.. of the cache it is run with);
    None where a projection is not in quantized blocks, or is a tensor-parallel shard (whose sums
    over ranks happen in the modules)."""
    slots = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
             for layer in layers]
    if not layers or not all(p.quantized and p.collective is None for projections in slots for p in projections):
        return None
    stack = native.decoder_stack(len(layers), config.num_heads, config.num_kv_heads, config.head_dim,
                                 config.rms_norm_eps)
    for index, (layer, projections) in enumerate(zip(layers, slots, strict=True)):
        stack.set_norms(index, layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach())
        for slot, projection in enumerate(projections):
            for op, tensors, ints in _kernel_calls(projection):
                stack.add_part(index, slot, op, tensors, ints)
            if projection.fused_bias is not None:
                stack.set_bias(index, slot, projection.fused_bias)
        swiglu = _swiglu_call(layer.mlp.gate_up_proj)
        if swiglu is not None:
            stack.set_swiglu(index, *swiglu)
    return stack


def _swiglu_call(gate_up: Projection) -> tuple[str, list[torch.Tensor], list[int]] | None:
    """`native.silu_mul` of the gate/up projection as one op (`tiled_swiglu`: the same bits), where
    it is one weight in tiles, gate's outputs then up's (None: the two ops)."""
    calls = _kernel_calls(gate_up)
    if len(calls) != 1 or gate_up.fused_bias is not None or calls[0][0] != "specserve_cpu::tiled_matmul":
        return None
    _, tensors, ints = calls[0]
    return ("specserve_cpu::tiled_swiglu", tensors, ints) if tensors[0].shape[0] % 2 == 0 else None


def _kernel_calls(projection: Projection) -> list[tuple[str, list[torch.Tensor], list[int]]]:
    """Each quantized weight of the projection as the stack binds it: its op's name, tensors, ints."""
    calls = []
    for weight in projection.quantized:
        op, args = weight.kernel_call()
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        calls.append((op.name(), tensors, list(args[len(tensors):])))
    return calls

