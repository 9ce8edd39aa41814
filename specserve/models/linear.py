"""Linear projections that keep two forms of the same weights, one per regime of step size.

`y = x W^T + b`, where W stacks row blocks `[W_0; W_1; ...]` (q/k/v, gate/up, or one block).

* Small steps (decode, verification trees, short chunks: < LARGE_STEP_TOKENS tokens) are bound by
  memory bandwidth and per-call overhead. They run one fused matmul; in bf16 on a CPU with
  oneDNN, over a weight prepacked once for the AMX kernel (a plain bf16 matmul re-lays out its
  weight on every call: packing makes a SmolLM2 decode step about 20% faster).
* Large steps (long prefill chunks) are compute-bound, so fusing saves nothing. They run one
  matmul per block over the plain weights: the very calls transformers makes, so a long prompt
  gives bit-identical results (oneDNN picks its accumulation order by shape, and both the fused
  and the packed matmuls round differently from transformers' at a few hundred rows).

A draft model may also quantize its projections to int8 (`Projection.quantize_int8`): small
steps then read half the bytes. Drafts only, since it changes the outputs a little.

In packed mode the plain blocks are zero-copy views of the memory-mapped checkpoint: file-backed
pages the kernel can drop under pressure, touched only by large steps.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.gguf import BlockWeight, QuantizedRows

LARGE_STEP_TOKENS = 128
PACK_BATCH_HINT = 64  # the oneDNN packing measured fastest for every step size up to 128 tokens
_weights_generation = 0  # bumped whenever any projection takes new weights


def weights_generation() -> int:
    """A number that changes whenever any projection's weights change: what was built over the
    weights (a model's `DecoderStack`) is stale when it differs from the one it was built at."""
    return _weights_generation


def weights_changed() -> None:
    global _weights_generation
    _weights_generation += 1


def packing_available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """bf16 on a CPU whose oneDNN has native bf16 (AVX512-BF16 / AMX); SPECSERVE_PACKED_LINEAR=0 turns it off."""
    if os.environ.get("SPECSERVE_PACKED_LINEAR", "1") == "0":
        return False
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class DirectModule(nn.Module):
    """Called without `nn.Module.__call__`'s hook machinery (nothing of ours registers hooks): a
    small model's decode makes ~270 module calls, and that machinery was 4% of it on a CPU."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class Projection(DirectModule):
    def __init__(self, in_features: int, out_sizes: Sequence[int]):
        super().__init__()
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        self.blocks: list[torch.Tensor] = []  # plain weight per block, [out_i, in]
        self.biases: list[torch.Tensor | None] = []
        self.fused: torch.Tensor | None = None  # plain fused weight (unpacked mode)
        self.packed: torch.Tensor | None = None  # oneDNN-packed fused weight (packed mode)
        self.fused_bias: torch.Tensor | None = None
        self.int8: torch.ScriptObject | None = None  # fbgemm-packed int8 fused weight (drafts only)
        # GGUF blocks, kept quantized (every step size): one fused weight, or one per block when
        # their formats differ (a Q4_K_M file mixes Q4_K and Q6_K within q/k/v).
        self.quantized: list[QuantizedRows] = []
        # Tensor parallelism: what joins this rank's output with the other ranks' (a sum, a gather)
        self.collective: Callable[[torch.Tensor], torch.Tensor] | None = None

    def load_quantized(self, blocks: Sequence[QuantizedRows], biases: Sequence[torch.Tensor] | None,
                       tiles: bool = True) -> None:
        """Take GGUF block weights (one per block, in order); they stay in their own format.
        `tiles=False` leaves this CPU's layout to the first matmul (weights about to be requantized)."""
        weights_changed()
        shapes = [b.shape for b in blocks]
        if shapes != [(n, self.in_features) for n in self.out_sizes]:
            raise ValueError(f"weights {shapes} do not fit a projection {self.in_features} -> {self.out_sizes}")
        self.fused_bias = torch.cat([b.float() for b in biases]) if biases else None
        fused = QuantizedRows.stack(list(blocks))
        self.quantized = [fused] if fused is not None else list(blocks)
        for weight in self.quantized if tiles else ():
            weight.tiles()  # this CPU's layout made now, not in the first request's step

    def restore_quantized(self, weights: Sequence[QuantizedRows], fused_bias: torch.Tensor | None) -> None:
        """Take weights as `load_quantized` left them (fused, tiles made), e.g. from prepared weights."""
        weights_changed()
        if sum(w.shape[0] for w in weights) != sum(self.out_sizes) or any(w.shape[1] != self.in_features
                                                                           for w in weights):
            raise ValueError(f"weights {[w.shape for w in weights]} do not fit a projection "
                             f"{self.in_features} -> {self.out_sizes}")
        self.quantized, self.fused_bias = list(weights), fused_bias

    def requantize(self, bits: int) -> None:
        """The weights into blocks of `bits` (`BlockWeight.quantize`) that the CPU kernel runs:
        plain ones, or blocks of other formats by their exact fp32 values (which then stack into
        one fused weight where their formats differed, as a Q4_K_M file's q/k/v do)."""
        biases = list(self.fused_bias.split(self.out_sizes)) if self.fused_bias is not None else None
        self.load_quantized([BlockWeight.quantize(w, bits) for w in self.dense_blocks()], biases)
        self.blocks, self.biases, self.fused, self.packed = [], [], None, None

    def dense_blocks(self) -> list[torch.Tensor]:
        """The weight of each block as a plain [out_i, in] tensor, however it is stored (quantized
        blocks by their exact fp32 values): for tools that copy a weight, never the forward."""
        if not self.quantized:
            return list(self.blocks)
        return list(torch.cat([w.dequantize() for w in self.quantized]).split(self.out_sizes))

    def dense_biases(self) -> list[torch.Tensor | None]:
        """The bias of each block (None where it has none), however the weights are stored."""
        if self.fused_bias is None:
            return [None] * len(self.out_sizes)
        return list(self.fused_bias.split(self.out_sizes))

    def select_rows(self, rows: torch.Tensor) -> Projection:
        """A one-block projection computing only output rows `rows` (a restricted LM head)."""
        if self.fused_bias is not None or len(self.out_sizes) != 1:
            raise ValueError("only a single-block projection without bias can be restricted to rows")
        head = Projection(self.in_features, [len(rows)])
        if self.quantized:
            head.load_quantized([self.quantized[0].permute_rows(rows)], None)
        else:
            head.load([self.blocks[0][rows].contiguous()], None, pack=self.packed is not None)
        return head

    def load(self, blocks: Sequence[torch.Tensor], biases: Sequence[torch.Tensor] | None, pack: bool) -> None:
        """Take the checkpoint's weights (one per block, in order); `pack` selects packed mode."""
        weights_changed()
        shapes = [tuple(b.shape) for b in blocks]
        if shapes != [(n, self.in_features) for n in self.out_sizes]:
            raise ValueError(f"weights {shapes} do not fit a projection {self.in_features} -> {self.out_sizes}")
        self.fused_bias = torch.cat(list(biases)) if biases else None
        self.biases = list(self.fused_bias.split(self.out_sizes)) if biases else [None] * len(blocks)
        fused = blocks[0] if len(blocks) == 1 else torch.cat(list(blocks))
        if pack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(fused, PACK_BATCH_HINT)
            self.blocks = list(blocks)
        else:  # one copy: the blocks are views of the fused weight
            self.fused = fused
            self.blocks = list(fused.split(self.out_sizes))

    def quantize_int8(self) -> None:
        """Small steps from now on run an int8 matmul (per-output-channel weight scales, activations
        quantized per call): half the bytes of bf16 to read, for a draft model whose forwards are
        bandwidth-bound. It changes the outputs slightly, so it is for drafts only, whose tokens
        the target verifies anyway. Large steps keep the plain weights."""
        weights_changed()
        if self.quantized:
            return  # GGUF blocks already read fewer bytes than int8
        weight = (self.blocks[0] if len(self.blocks) == 1 else torch.cat(self.blocks)).float()
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
        zero_points = torch.zeros(len(scales), dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated; torch is pinned (2.13) and has them
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        bias = None if self.fused_bias is None else self.fused_bias.float()
        self.int8 = torch.ops.quantized.linear_prepack(quantized, bias)
        self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._local_forward(x)
        return y if self.collective is None else self.collective(y)

    def _local_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            return self._quantized_forward(x)
        if x.shape[0] < LARGE_STEP_TOKENS:
            if self.int8 is not None:  # reduce_range: fbgemm's 7-bit activations, which cannot overflow
                return torch.ops.quantized.linear_dynamic(x.float(), self.int8, True).to(x.dtype)
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.fused_bias, "none", [], "")
            return F.linear(x, self.fused, self.fused_bias)
        if len(self.blocks) == 1:
            return F.linear(x, self.blocks[0], self.biases[0])
        return torch.cat([F.linear(x, w, b) for w, b in zip(self.blocks, self.biases, strict=True)], dim=-1)

    def _quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.quantized) == 1 and self.fused_bias is None:  # the common case, in one call
            return self.quantized[0].kernel()(x)
        outs = [w.matmul(x) for w in self.quantized]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if self.fused_bias is None else y + self.fused_bias

    def extra_repr(self) -> str:
        if self.quantized:
            kinds = "+".join(w.source_type for w in self.quantized)
            return f"in_features={self.in_features}, out_sizes={self.out_sizes}, {kinds} blocks"
        mode = "packed" if self.packed is not None else "plain"
        return f"in_features={self.in_features}, out_sizes={self.out_sizes}, {mode}"


class QuantizedEmbedding(DirectModule):
    """Token embeddings kept in their GGUF blocks: a lookup dequantizes only the rows it reads,
    exactly as `gguf` would (see `BlockWeight.dequantize`)."""

    def __init__(self, weight: QuantizedRows, dtype: torch.dtype):
        super().__init__()
        self.blocks, self.dtype = weight, dtype

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, dequantized (for tools that need it; the forward never does this)."""
        return self.blocks.dequantize().to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.blocks.dequantize(ids.reshape(-1)).to(self.dtype).view(*ids.shape, -1)
