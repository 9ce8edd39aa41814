"""Torch implementation of tree attention over a paged KV cache.

This is the CPU path and the oracle the Triton kernel must match. Semantics (one call
serves prefill chains, decode nodes and verification trees alike):

* new token t of request b (tree node i) writes its K/V at slot `context_len + i` of b's
  logical sequence, i.e. physical slot `meta.slot_mapping[t]`;
* it attends to b's `context_len` cached tokens and to its ancestors and itself.

Caches are `[num_blocks, block_size, num_kv_heads, head_dim]` per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata

# Padded attention runs over a key axis rounded up to a multiple of this (the padding masked).
# CPU SDPA rounds a query's result differently when the key axis ends in a partial block of
# its vectorised loops, so without this a request's attention (in bf16 visibly) changes with
# the keys the others in its call add: a decode batched with longer requests, or the root of a
# verification tree, whose own tree adds keys after it. With whole blocks only, each query
# gets the same bits whatever is masked after its keys. Not a row whatever the other queries
# (SDPA tiles them too): the model's bf16 attention takes the C++ kernel (`kernels.cpu_attention`).
KEY_ALIGN = 32


# An int8 cache row (one token's K or V of one K/V head) is its head_dim codes followed by one scale
# byte per group of KV_GROUP channels (one group for head sizes that are not a multiple): the
# scales sit beside their codes, so anything that moves, shares or counts rows (compaction, prefix
# caching, the block manager) needs no second tensor. A scale per 32 channels keeps small channels
# beside outlier ones far better than one per row, and in one byte costs what one fp16 did for
# 64-dim heads: 66 bytes against bf16's 128.
KV_GROUP = 32
# A scale byte: 5 exponent bits (1-31; 0 is scale 0) and 3 mantissa bits, 2^(e - 24) (1 + m / 8):
# 2^-23 to 240, always rounded up from max |x| / 127 so codes stay within +-127. Its values are
# exact in fp32, and so is every code times its scale.
SCALE_EXPONENT_BIAS = 24


def scale_groups(head_dim: int) -> int:
    return head_dim // KV_GROUP if head_dim % KV_GROUP == 0 else 1


def scale_group_size(head_dim: int) -> int:
    """The channels one scale byte covers in a row of `head_dim` (KV_GROUP, or the whole row)."""
    return head_dim // scale_groups(head_dim)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The last dimension of a cache of `dtype`: head_dim values, plus the scale bytes for int8."""
    if dtype != torch.int8:
        return head_dim
    width = head_dim + scale_groups(head_dim)
    if head_dim_of(width) != head_dim:  # 98, 164, ...: a row width a multiple of 32 also has
        raise ValueError(f"an int8 KV cache cannot hold heads of {head_dim} channels: use --kv-cache-dtype auto")
    return width


def head_dim_of(width: int) -> int:
    """The head size of int8 cache rows `width` wide (head sizes that are multiples of 32 first)."""
    return width * KV_GROUP // (KV_GROUP + 1) if width % (KV_GROUP + 1) == 0 else width - 1


def encode_scales(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales >= 0 as scale bytes (uint8): the smallest representable scale >= each."""
    bits = scale.float().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + SCALE_EXPONENT_BIAS
    mantissa = ((bits >> 20) & 7) + ((bits & 0xFFFFF) != 0).int()  # rounded up to 3 bits
    exponent, mantissa = exponent + (mantissa >> 3), mantissa & 7
    low = exponent < 1  # below 2^-23 (subnormals too): the smallest scale
    exponent, mantissa = torch.where(low, 1, exponent), torch.where(low, 0, mantissa)
    high = exponent > 31  # saturates: codes then clamp at +-127
    exponent, mantissa = torch.where(high, 31, exponent), torch.where(high, 7, mantissa)
    return torch.where(scale > 0, exponent * 8 + mantissa, 0).to(torch.uint8)


def decode_scales(codes: torch.Tensor) -> torch.Tensor:
    """Scale bytes as fp32 scales (built from their bits: exact)."""
    c = codes.view(torch.uint8).int()
    bits = (((c >> 3) - SCALE_EXPONENT_BIAS + 127) << 23) | ((c & 7) << 20)
    return torch.where(c > 0, bits.view(torch.float32), 0.0)


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """K or V rows `[..., D]` as int8 cache rows `[..., D + groups]`: per group of channels a scale
    byte (max |x| / 127 rounded up) and codes round-half-even(x / scale), scales after the codes."""
    *lead, head_dim = x.shape
    groups = x.float().reshape(*lead, scale_groups(head_dim), -1)
    scale_bytes = encode_scales(groups.abs().amax(dim=-1) / 127)
    scale = decode_scales(scale_bytes).unsqueeze(-1)
    codes = torch.round(groups / torch.where(scale > 0, scale, 1.0)).clamp(-127, 127).to(torch.int8)
    return torch.cat([codes.reshape(*lead, head_dim), scale_bytes.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as K or V values in `dtype`: int8 rows as codes times their group's scale, others as they are."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    head_dim = head_dim_of(rows.shape[-1])
    lead = rows.shape[:-1]
    scale = decode_scales(rows[..., head_dim:]).unsqueeze(-1)
    codes = rows[..., :head_dim].float().reshape(*lead, scale.shape[-2], -1)
    return (codes * scale).reshape(*lead, head_dim).to(dtype)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V (`[T, Hkv, D]`) into their cache slots (int8 caches: quantized per group)."""
    num_kv_heads, width = k_cache.shape[-2:]
    for new, cache in ((k, k_cache), (v, v_cache)):
        rows = quantize_kv(new) if cache.dtype == torch.int8 else new.to(cache.dtype)
        slots = cache.view(-1, num_kv_heads, width)
        if cache.dtype == torch.float8_e4m3fn:  # CUDA's index_copy_ has no fp8 kernel: copy the bytes
            slots, rows = slots.view(torch.uint8), rows.view(torch.uint8)
        slots.index_copy_(0, slot_mapping, rows)


def paged_tree_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention of new tokens `q` (`[T, Hq, D]`) over the cache (their own K/V already written).

    Requests of similar tree length are padded to one batch, so a step is one SDPA call per
    group (`meta.padding_groups`: decodes, trees, prompt chunks): on a CPU the per-call
    overhead dominates small decode steps, while padding every decode up to the longest tree
    would multiply the attention work.
    """
    if meta.is_fresh_prefill:
        return _causal_prefill(q, k_cache, v_cache, meta, scale)
    groups = meta.padding_groups
    if len(groups) == 1:
        return _padded_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    for tokens, group in groups:  # index_select / index_copy_: faster than advanced indexing here
        out.index_copy_(0, tokens, _padded_attention(q.index_select(0, tokens), k_cache, v_cache, group, scale))
    return out


def _padded_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """All of `meta`'s requests padded to its longest tree, in one SDPA call."""
    _, num_heads, head_dim = q.shape
    batch, max_n, seq_len = meta.num_requests, meta.max_tree_len, meta.max_seq_len
    num_kv_heads = k_cache.shape[-2]
    group = num_heads // num_kv_heads
    # index_select of whole blocks is ~3x faster than advanced indexing for this gather.
    blocks = meta.block_tables[:, : -(-seq_len // meta.block_size)].flatten()
    width = k_cache.shape[-1]
    keys, values = (dequantize_kv(cache.index_select(0, blocks).view(batch, -1, num_kv_heads, width)[:, :seq_len],
                                  q.dtype).transpose(1, 2) for cache in (k_cache, v_cache))
    aligned = -(-seq_len // KEY_ALIGN) * KEY_ALIGN
    if aligned > seq_len:  # zeros, not stale cache rows: a masked key must not bring a NaN
        keys = F.pad(keys, (0, 0, 0, aligned - seq_len))
        values = F.pad(values, (0, 0, 0, aligned - seq_len))
    if meta.is_rectangular:  # every tree the same size (e.g. all decoding): no padding to add or remove
        queries = q.view(batch, max_n, num_heads, head_dim)
    else:
        queries = q.new_zeros(batch * max_n, num_heads, head_dim)
        queries[meta.padded_index] = q
        queries = queries.view(batch, max_n, num_heads, head_dim)
    # The query heads sharing a K/V head are folded into the query axis: a plain multi-head call
    # over the K/V heads, which CPU SDPA runs ~2x faster than its grouped-query path for trees.
    queries = queries.permute(0, 2, 1, 3).reshape(batch, num_kv_heads, group * max_n, head_dim)
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=meta.additive_key_mask(q.dtype, group, aligned),
        scale=scale,
    )
    # (reshape: CUDA's SDPA may return [batch, kv heads, group x nodes, d] in another memory order)
    out = out.reshape(batch, num_heads, max_n, head_dim).transpose(1, 2).reshape(batch * max_n, num_heads, head_dim)
    return out if meta.is_rectangular else out[meta.padded_index]


def _causal_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """A lone chain with an empty context: `is_causal` needs no mask (and is what transformers runs)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, width = k_cache.shape[-2:]
    keys, values = (dequantize_kv(cache.view(-1, num_kv_heads, width)[meta.slot_mapping], q.dtype).transpose(0, 1)
                    for cache in (k_cache, v_cache))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None],
        is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads,
    )
    return out[0].transpose(0, 1).reshape(num_tokens, num_heads, head_dim)


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The one attention entry point: write the step's K/V, then attend under the tree mask."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return paged_tree_attention(q, k_cache, v_cache, meta, scale)


def compact_kv(cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Move K or V from `src_slots` to `dst_slots` (flat slot indices) in place.

    `cache` is `[..., num_blocks, block_size, H, D]` (leading dims, e.g. layers, allowed).
    The source rows are gathered before any write, so overlapping moves are safe.
    """
    if src_slots.numel() == 0:
        return
    flat = cache.view(*cache.shape[:-4], -1, *cache.shape[-2:])
    flat[..., dst_slots, :, :] = flat[..., src_slots, :, :]
