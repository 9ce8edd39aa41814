"""Triton kernels: tree attention over the paged KV cache, K/V writes and KV compaction.

One launch computes, for a flat unpadded batch of new tokens from many requests, each
token's attention over its request's cached context (in full) and over its own tree
nodes (ancestors and itself): the semantics of `kernels.reference`. Prefill chunks
(chains), decode steps (single nodes) and verification trees all run this one kernel.

Layout of the work:

* one program per (request, tile of `BLOCK_Q` tree nodes, KV head[, context split]);
* its rows are the tile's nodes x the query heads sharing that KV head (GQA), so K/V are
  read once per group and the rows of a `tl.dot` reach 16 even for a single decode node;
* keys stream in `BLOCK_N` tiles gathered through the block table, with a FlashAttention
  online softmax accumulated in fp32: first the context (no mask), then the tree's own
  keys under the tree mask, a bitmask per node (trees of <= 64 nodes) or a dense mask;
* when the batch is too small to fill the GPU, the context is split across programs
  (flash-decoding) and a second kernel merges the partial softmaxes;
* caches of any dtype: K/V are converted to the queries' dtype as loaded; int8 rows (codes and
  a scale byte per 32 channels, `kernels.reference.quantize_kv`) are dequantized there, and the
  int8 write kernel quantizes to the reference's very bits; fp8 (e4m3) caches are read and
  written as they are.

The interpreter (`TRITON_INTERPRET=1`, read when this module is imported) runs the same
code on CPU tensors. There bf16 arithmetic is wrong, so every load is upcast to fp32
(`UPCAST`), and autotuning is off.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata
from kernels.reference import SCALE_EXPONENT_BIAS, row_width, scale_group_size

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpret_triton_language() -> None:
    """Make Triton's own jit helpers (`tl.zeros`, `tl.max`, `tl.sum`, ...) interpretable.

    Triton picks compiled or interpreted per function when the function is defined. If
    `triton.language` was imported before `TRITON_INTERPRET=1` was set (transformers imports
    it when it builds a model), its helpers are compiled-mode functions that the interpreter
    refuses to call. Re-wrap them; in an interpreting process nothing is compiled anyway.
    """
    from triton.runtime.interpreter import InterpretedFunction

    rewrapped: dict[int, InterpretedFunction] = {}
    for module in (tl, tl.standard, tl.math):
        for name, value in list(vars(module).items()):
            if isinstance(value, triton.runtime.JITFunction):
                if id(value) not in rewrapped:
                    rewrapped[id(value)] = InterpretedFunction(value.fn)
                setattr(module, name, rewrapped[id(value)])


if INTERPRET:
    _interpret_triton_language()
BITMASK_MAX_NODES = 64  # one int64 of ancestor bits per node
# Globals a compiled kernel reads must be constexpr (the interpreter reads any global; the compiler refuses).
_SCALE_BIAS = tl.constexpr(SCALE_EXPONENT_BIAS)
_LOG2E = 1.4426950408889634


def _attention_configs() -> list[triton.Config]:
    if INTERPRET:  # the interpreter runs one config; larger key tiles mean fewer interpreted steps
        return [triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=1)]
    if os.environ.get("SPECSERVE_TRITON_AUTOTUNE", "1") == "0":  # e.g. tests: skip the tuning compiles
        # the one config of the list that spills no registers on sm_90 over bf16, int8 or fp8 caches
        return [triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=3)]
    return [
        triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
        for block_n, warps, stages in ((32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2))
    ]


@triton.jit
def _cast(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """`x.to(dtype)`, except that the interpreter truncates fp32 -> bf16: round to nearest even by hand."""
    if UPCAST and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + ((bits >> 16) & 1) + 0x7FFF) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _decode_scales(codes):
    """Scale bytes (as loaded, int8) as fp32 scales, built from their bits as the reference does."""
    c = codes.to(tl.int32) & 0xFF
    bits = (((c >> 3) - _SCALE_BIAS + 127) << 23) | ((c & 7) << 20)
    return tl.where(c > 0, bits.to(tl.float32, bitcast=True), 0.0)


@triton.jit
def _load_rows(cache_ptr, rows, key_valid, d_valid, offs_d, dtype: tl.constexpr, HEAD_DIM: tl.constexpr,
               SCALE_GROUP: tl.constexpr, KV_INT8: tl.constexpr):
    """The K or V rows starting at element offsets `rows`, as values of `dtype`: int8 rows as their
    codes times their group's scale (the bytes after the codes), any other cache dtype converted."""
    x = tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=key_valid[:, None] & d_valid[None, :],
                other=0.0).to(tl.float32)
    if KV_INT8:
        # One scale byte per (row, group), decoded once and broadcast over its channels: per
        # element loads and bit arithmetic spilled registers (2-4 KB of stack on sm_90).
        n: tl.constexpr = x.shape[0]
        width: tl.constexpr = x.shape[1]  # head_dim padded to a power of two
        if SCALE_GROUP == HEAD_DIM:
            codes = tl.load(cache_ptr + rows + HEAD_DIM, mask=key_valid, other=0)
            x = x * _decode_scales(codes)[:, None]
        else:  # groups of a power-of-two size (KV_GROUP): the padded row splits into whole groups
            groups: tl.constexpr = width // SCALE_GROUP
            g = tl.arange(0, groups)
            group_mask = key_valid[:, None] & (g < HEAD_DIM // SCALE_GROUP)[None, :]
            codes = tl.load(cache_ptr + rows[:, None] + HEAD_DIM + g[None, :], mask=group_mask, other=0)
            x = tl.reshape(tl.reshape(x, (n, groups, SCALE_GROUP)) * _decode_scales(codes)[:, :, None], (n, width))
    return x.to(dtype)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, keys, key_valid, allowed,
    k_cache_ptr, v_cache_ptr, block_table_row, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    offs_d, d_valid, scale_log2,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE_GROUP: tl.constexpr, KV_INT8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax update of every row over the key tile `keys` (logical positions)."""
    block = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    slot = keys % BLOCK_SIZE
    if KV_INT8:  # rows start at multiples of their width (checked on launch): said so, the loads are wide
        width: tl.constexpr = HEAD_DIM + HEAD_DIM // SCALE_GROUP
        k_rows = (block * (stride_kb // width) + slot * (stride_ks // width) + kv_head * (stride_kh // width)) * width
        v_rows = (block * (stride_vb // width) + slot * (stride_vs // width) + kv_head * (stride_vh // width)) * width
    else:
        k_rows = block * stride_kb + slot * stride_ks + kv_head * stride_kh
        v_rows = block * stride_vb + slot * stride_vs + kv_head * stride_vh
    k = _load_rows(k_cache_ptr, k_rows, key_valid, d_valid, offs_d, q.dtype, HEAD_DIM, SCALE_GROUP, KV_INT8)
    v = _load_rows(v_cache_ptr, v_rows, key_valid, d_valid, offs_d, q.dtype, HEAD_DIM, SCALE_GROUP, KV_INT8)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A row that has seen no allowed key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, query_start_ptr, context_lens_ptr, tree_lens_ptr,
    tree_bits_ptr, dense_mask_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale_log2, num_splits, num_heads,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt, stride_mb, stride_mi,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CHAIN: tl.constexpr, USE_BITMASK: tl.constexpr, SPLIT: tl.constexpr, SPLIT_ALIGN: tl.constexpr,
    SCALE_GROUP: tl.constexpr, KV_INT8: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    request = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    tree_len = tl.load(tree_lens_ptr + request)
    if q_tile * BLOCK_Q >= tree_len:
        return
    q_start = tl.load(query_start_ptr + request)
    context_len = tl.load(context_lens_ptr + request)
    block_table_row = block_tables_ptr + request * stride_bt

    # Rows: BLOCK_Q nodes x GROUP_P query heads of this KV head (padded to a power of two).
    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    node = q_tile * BLOCK_Q + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_valid = (node < tree_len) & (rows % GROUP_P < GROUP)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_valid = offs_d < HEAD_DIM
    token = q_start + node
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM_P], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    # 1. This split's share of the cached context: every row sees every key. Shares are sized per
    # request, so a launch's arguments do not depend on the step's contexts (a CUDA graph replays it).
    split_size = tl.cdiv(tl.cdiv(context_len, num_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    context_lo = split * split_size
    context_hi = tl.minimum(context_len, context_lo + split_size)
    for start in range(context_lo, context_hi, BLOCK_N):
        keys = start + offs_n
        key_valid = keys < context_hi
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, keys, key_valid, key_valid[None, :],
            k_cache_ptr, v_cache_ptr, block_table_row, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            offs_d, d_valid, scale_log2, BLOCK_SIZE, HEAD_DIM, SCALE_GROUP, KV_INT8, DOT_PRECISION,
        )

    # 2. The tree's own keys (last split only), up to the tile's last node: ancestors precede a node.
    if split == num_splits - 1:
        tree_end = tl.minimum(tree_len, (q_tile + 1) * BLOCK_Q)
        if USE_BITMASK:
            bits = tl.load(tree_bits_ptr + token, mask=row_valid, other=0)
        for start in range(0, tree_end, BLOCK_N):
            key_node = start + offs_n
            key_valid = key_node < tree_end
            if IS_CHAIN:  # prefill chunks: plain causal
                is_ancestor = key_node[None, :] <= node[:, None]
            elif USE_BITMASK:
                shift = tl.where(key_valid, key_node, 0).to(tl.int64)
                is_ancestor = ((bits[:, None] >> shift[None, :]) & 1) != 0
            else:
                is_ancestor = tl.load(
                    dense_mask_ptr + request * stride_mb + node[:, None] * stride_mi + key_node[None, :],
                    mask=row_valid[:, None] & key_valid[None, :], other=0,
                ) != 0
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, context_len + key_node, key_valid, is_ancestor & key_valid[None, :],
                k_cache_ptr, v_cache_ptr, block_table_row, kv_head,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                offs_d, d_valid, scale_log2, BLOCK_SIZE, HEAD_DIM, SCALE_GROUP, KV_INT8, DOT_PRECISION,
            )

    out_mask = row_valid[:, None] & d_valid[None, :]
    if not SPLIT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            _cast(out, out_ptr.dtype.element_ty, UPCAST), mask=out_mask,
        )
    else:  # partials [T, Hq, num_splits(, D)], merged by _merge_splits_kernel
        part = (token * num_heads + head) * num_splits + split
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, stride_ot, stride_oh, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SPLITS_P: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s for one (token, query head)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS_P)
    s_valid = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_valid = offs_d < HEAD_DIM
    part = (token * num_heads + head) * num_splits + offs_s
    m = tl.load(part_max_ptr + part, mask=s_valid, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=s_valid, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_valid[:, None] & d_valid[None, :],
                  other=0.0)
    m_max = tl.max(m, axis=0)  # finite: the last split always holds the node itself
    weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_s * weight, axis=0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, _cast(out, out_ptr.dtype.element_ty, UPCAST),
             mask=d_valid)


_tuned_attention = triton.autotune(
    configs=_attention_configs(),
    key=["HEAD_DIM", "GROUP_P", "BLOCK_Q", "IS_CHAIN", "USE_BITMASK", "SPLIT", "BLOCK_SIZE", "KV_INT8"],
)(_tree_attention_kernel)

# Context tiles are split at multiples of the largest key tile any config uses.
_SPLIT_ALIGN = 128


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rows_per_head_group(max_tree_len: int, group_p: int) -> int:
    """Tree nodes per program: enough rows for a 16-row dot, at most 128 rows of registers."""
    return max(16 // group_p, min(_next_pow2(max_tree_len), max(1, 128 // group_p)))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(max_context: int, programs: int, device: torch.device) -> int:
    """Split long contexts across programs when the batch alone leaves the GPU's SMs idle."""
    if INTERPRET or device.type != "cuda":
        return 1
    sms = _multiprocessors(device)
    if programs >= sms or max_context < 2 * _SPLIT_ALIGN:
        return 1
    return max(1, min(-(-2 * sms // programs), max_context // _SPLIT_ALIGN, 32))


def paged_tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of new tokens `q` (`[T, Hq, D]`) over the paged cache; their K/V already written.

    `num_splits` forces the number of context splits (None: chosen from the GPU's size).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, width = k_cache.shape
    kv_int8 = k_cache.dtype == torch.int8
    if width != row_width(head_dim, k_cache.dtype) or num_heads % num_kv_heads or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q {tuple(q.shape)} does not fit a {k_cache.dtype} cache of {num_kv_heads} heads x {width}")
    if head_dim % 16:  # tl.dot needs dims >= 16 (and the GPU wants 16-aligned rows)
        raise ValueError(f"the Triton kernel needs head_dim divisible by 16, got {head_dim}: "
                         "use SPECSERVE_ATTENTION=reference")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last (head_dim) dimension")
    if kv_int8 and any(c.stride(d) % width for c in (k_cache, v_cache) for d in range(3)):
        raise ValueError(f"an int8 cache's rows must start at multiples of their width {width}")
    group = num_heads // num_kv_heads
    group_p = _next_pow2(group)
    block_q = _rows_per_head_group(meta.max_tree_len, group_p)
    q_tiles = -(-meta.max_tree_len // block_q)
    use_bitmask = meta.max_tree_len <= BITMASK_MAX_NODES
    if num_splits is None:
        num_splits = _num_splits(meta.max_context_len, meta.num_requests * q_tiles * num_kv_heads, q.device)

    out = torch.empty_like(q)
    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    tree_bits = meta.tree_bitmask if use_bitmask else meta.context_lens  # the unused one is a placeholder
    dense_mask = meta.ancestor_mask.view(torch.uint8)
    grid = (meta.num_requests, q_tiles, num_kv_heads * num_splits)
    _tuned_attention[grid](
        q, k_cache, v_cache, out,
        meta.block_tables, meta.query_start_loc, meta.context_lens, meta.tree_lens,
        tree_bits, dense_mask,
        part_acc, part_max, part_sum,
        scale * _LOG2E, num_splits, num_heads,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        meta.block_tables.stride(0), dense_mask.stride(0), dense_mask.stride(1),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_P=_next_pow2(head_dim),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q,
        IS_CHAIN=meta.all_chains, USE_BITMASK=use_bitmask, SPLIT=num_splits > 1, SPLIT_ALIGN=_SPLIT_ALIGN,
        SCALE_GROUP=scale_group_size(head_dim), KV_INT8=kv_int8,
        UPCAST=INTERPRET, DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, out.stride(0), out.stride(1), num_heads, num_splits,
            HEAD_DIM=head_dim, HEAD_DIM_P=_next_pow2(head_dim), NUM_SPLITS_P=_next_pow2(num_splits),
            UPCAST=INTERPRET,
        )
    return out


# -- K/V writes --------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_k_slot, stride_v_slot,
    HEAD_DIM: tl.constexpr, ROW: tl.constexpr, ROW_P: tl.constexpr, UPCAST: tl.constexpr,
):
    """Copy token t's K and V (`[Hkv, D]`, any head stride) into cache slot `slot_mapping[t]`;
    a negative slot is padding (a step padded to a captured graph's size): nothing written."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    offs = tl.arange(0, ROW_P)
    valid = offs < ROW
    head, d = offs // HEAD_DIM, offs % HEAD_DIM
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=valid, other=0.0)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=valid, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    tl.store(k_cache_ptr + slot * stride_k_slot + offs, _cast(k, k_cache_ptr.dtype.element_ty, UPCAST), mask=valid)
    tl.store(v_cache_ptr + slot * stride_v_slot + offs, _cast(v, v_cache_ptr.dtype.element_ty, UPCAST), mask=valid)


@triton.jit
def _quantize_rows(x_ptr, stride_xt, stride_xh, cache_ptr, token, slot, stride_slot, heads, head_valid,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, SCALE_GROUP_P: tl.constexpr,
                   SCALE_GROUP: tl.constexpr):
    """Token `token`'s K or V heads as int8 rows in `slot`, the bits the reference writes: per group
    of channels the smallest scale byte >= max |x| / 127, codes round-half-even(x / scale)."""
    groups: tl.constexpr = HEAD_DIM_P // SCALE_GROUP_P
    g = tl.arange(0, groups)
    c = tl.arange(0, SCALE_GROUP_P)
    d = g[None, :, None] * SCALE_GROUP + c[None, None, :]  # [1, groups, group]: the channel
    valid = head_valid[:, None, None] & (c[None, None, :] < SCALE_GROUP) & (d < HEAD_DIM)
    x = tl.load(x_ptr + token * stride_xt + heads[:, None, None] * stride_xh + d, mask=valid, other=0.0)
    x = x.to(tl.float32)
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=2), 127.0)  # [heads, groups]
    # the smallest scale byte >= scale, from its bits (as reference.encode_scales)
    bits = scale.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127 + _SCALE_BIAS
    mantissa = ((bits >> 20) & 7) + ((bits & 0xFFFFF) != 0).to(tl.int32)
    exponent, mantissa = exponent + (mantissa >> 3), mantissa & 7
    low = exponent < 1
    exponent, mantissa = tl.where(low, 1, exponent), tl.where(low, 0, mantissa)
    high = exponent > 31
    exponent, mantissa = tl.where(high, 31, exponent), tl.where(high, 7, mantissa)
    code = tl.where(scale > 0, exponent * 8 + mantissa, 0)
    scale = _decode_scales(code)
    safe = tl.where(scale > 0, scale, 1.0)
    # x + 1.5 * 2^23 rounds to an integer, half to even, for |x| <= 2^22 (here |x / safe| <= 127)
    codes = (tl.math.div_rn(x, safe[:, :, None]) + 12582912.0) - 12582912.0
    codes = tl.minimum(tl.maximum(codes, -127.0), 127.0)
    rows = slot * stride_slot + heads * (HEAD_DIM + HEAD_DIM // SCALE_GROUP)  # the heads' rows
    tl.store(cache_ptr + rows[:, None, None] + d, codes.to(tl.int8), mask=valid)
    group_valid = head_valid[:, None] & (g[None, :] * SCALE_GROUP < HEAD_DIM)
    tl.store(cache_ptr + rows[:, None] + HEAD_DIM + g[None, :], code.to(tl.uint8).to(tl.int8, bitcast=True),
             mask=group_valid)


@triton.jit
def _write_kv_int8_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_slot, num_kv_heads,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, HEADS_P: tl.constexpr,
    SCALE_GROUP_P: tl.constexpr, SCALE_GROUP: tl.constexpr,
):
    """Quantize token t's K and V (`[Hkv, D]`) into int8 cache slot `slot_mapping[t]` (negative: padding)."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P)
    head_valid = heads < num_kv_heads
    _quantize_rows(k_ptr, stride_kt, stride_kh, k_cache_ptr, token, slot, stride_slot, heads, head_valid,
                   HEAD_DIM, HEAD_DIM_P, SCALE_GROUP_P, SCALE_GROUP)
    _quantize_rows(v_ptr, stride_vt, stride_vh, v_cache_ptr, token, slot, stride_slot, heads, head_valid,
                   HEAD_DIM, HEAD_DIM_P, SCALE_GROUP_P, SCALE_GROUP)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V (`[T, Hkv, D]`) into their cache slots (`[num_blocks, block_size, Hkv, D]`;
    int8 caches: `[.., Hkv, D + 2]`, quantized per row as the reference quantizes)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    width = row_width(head_dim, k_cache.dtype)
    for cache in (k_cache, v_cache):
        if not cache.is_contiguous() or tuple(cache.shape[-2:]) != (num_kv_heads, width):
            raise ValueError(f"cache {tuple(cache.shape)} must be contiguous with [.., {num_kv_heads}, {width}]")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("new K/V need a contiguous last (head_dim) dimension")
    row = num_kv_heads * width
    if k_cache.dtype == torch.int8:
        group = scale_group_size(head_dim)
        _write_kv_int8_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), row, num_kv_heads,
            HEAD_DIM=head_dim, HEAD_DIM_P=_next_pow2(head_dim), HEADS_P=_next_pow2(num_kv_heads),
            SCALE_GROUP_P=_next_pow2(group), SCALE_GROUP=group,
        )
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), row, row,
        HEAD_DIM=head_dim, ROW=row, ROW_P=_next_pow2(row), UPCAST=INTERPRET,
    )


# -- KV compaction after acceptance ------------------------------------------------------


@triton.jit
def _compact_kv_kernel(
    cache_ptr, src_ptr, dst_ptr, num_moves, stride_lead, ROW: tl.constexpr, BLOCK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Move rows src[i] -> dst[i] in order, for one leading index (layer) and one chunk of the row.

    In order, so a move may read a slot an earlier move *vacated* but never one an earlier
    move *wrote*: compaction moves each accepted node down to a lower slot (dst < src and
    destinations increase), which this order keeps safe.
    """
    base = cache_ptr + tl.program_id(0).to(tl.int64) * stride_lead  # a whole cache's layers pass 2**31 elements
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < ROW
    for i in range(num_moves):
        src = tl.load(src_ptr + i)
        dst = tl.load(dst_ptr + i)
        row = tl.load(base + src * ROW + offs, mask=valid, other=0.0)
        if UPCAST:
            row = row.to(tl.float32)
        tl.store(base + dst * ROW + offs, _cast(row, cache_ptr.dtype.element_ty, UPCAST), mask=valid)


def compact_kv(cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Move K or V from `src_slots` to `dst_slots` (flat slot indices, as `compaction_slots` orders them).

    `cache` is `[..., num_blocks, block_size, H, D]` (leading dims, e.g. layers, allowed).
    """
    if src_slots.numel() == 0:
        return
    if not cache.is_contiguous():
        raise ValueError("compact_kv needs a contiguous cache")
    row = cache.shape[-2] * cache.shape[-1]
    leading = math.prod(cache.shape[:-4])
    block = min(1024, _next_pow2(row))
    slots_per_lead = cache.shape[-4] * cache.shape[-3]
    _compact_kv_kernel[(leading, -(-row // block))](
        cache, src_slots, dst_slots, src_slots.numel(), slots_per_lead * row,
        ROW=row, BLOCK=block, UPCAST=INTERPRET,
    )
