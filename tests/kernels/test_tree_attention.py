"""The Triton kernels against the torch reference: attention, K/V writes and compaction.

On a machine without a GPU they run through Triton's interpreter (the real kernel code,
executed on CPU tensors); with a GPU they are compiled for it.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kernels import ops, reference
from kernels.metadata import AttentionMetadata, PaddedSize, compaction_slots, host_tensors, to_device
from specserve.tree import TokenTree

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
triton_kernels = pytest.importorskip("kernels.tree_attention", reason="Triton is not installed")

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def random_tree(rng: random.Random, n: int, shape: str) -> TokenTree:
    """chain = a prefill chunk, single = a decode step, wide = every node under the root, deep =
    a long spine with short branches, random = any parent."""
    if shape == "single" or n == 1:
        return TokenTree.single(7)
    if shape == "chain":
        return TokenTree.chain([7] * n)
    if shape == "wide":
        parents = [-1] + [0] * (n - 1)
    elif shape == "deep":
        parents = [-1] + [max(0, i - rng.choice([1, 1, 1, 2, 3])) for i in range(1, n)]
    else:
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return TokenTree((7,) * n, tuple(parents))


def paged_case(rng, trees, contexts, block_size, kv_heads, head_dim, dtype):
    """Caches with each request's context in shuffled, interleaved blocks, and its metadata."""
    needed = [-(-(ctx + len(tree)) // block_size) for ctx, tree in zip(contexts, trees, strict=True)]
    num_blocks = sum(needed) + 2
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables, used = [], 0
    for count in needed:
        tables.append(order[used : used + count])
        used += count
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    meta = AttentionMetadata.build(trees, contexts, tables, block_size, device=DEVICE)
    return meta, k_cache, v_cache


def assert_matches_reference(q, k_cache, v_cache, meta, dtype, num_splits=None):
    scale = q.shape[-1] ** -0.5
    out = triton_kernels.paged_tree_attention(q, k_cache, v_cache, meta, scale, num_splits=num_splits)
    # The reference in fp32 on the same (rounded) inputs: the kernel accumulates in fp32 too.
    expected = reference.paged_tree_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


# (query heads, kv heads, head_dim): GQA 1, 2, 4, MQA, SmolLM2's group of 3, and head_dim 64 / 128 / 32
HEADS = [(4, 4, 64), (4, 2, 128), (8, 2, 64), (8, 1, 32), (9, 3, 64), (4, 1, 16)]
SHAPES = ["chain", "single", "wide", "deep", "random"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
def test_random_trees_over_ragged_contexts(heads, dtype):
    num_heads, kv_heads, head_dim = heads
    rng = random.Random(hash((heads, str(dtype))) % 2**31)
    trees = [random_tree(rng, rng.choice([1, 3, 9, 24, 64]), shape) for shape in rng.sample(SHAPES, 3)]
    contexts = [rng.choice([0, 1, 15, 16, 17, 100, 300]) for _ in trees]
    meta, k_cache, v_cache = paged_case(rng, trees, contexts, rng.choice([16, 32]), kv_heads, head_dim, dtype)
    q = torch.randn(meta.num_tokens, num_heads, head_dim).to(DEVICE, dtype)
    assert_matches_reference(q, k_cache, v_cache, meta, dtype)


@pytest.mark.parametrize("seed", range(16))
def test_seeded_sweep_of_mixed_steps(seed):
    """Anything goes in one step: 1-5 requests, each tree shape and size, contexts 0..300,
    block sizes 16-64, any GQA ratio, any dtype."""
    rng = random.Random(1000 + seed)
    kv_heads = rng.choice([1, 2, 4])
    num_heads = kv_heads * rng.choice([1, 2, 3, 4])
    head_dim = rng.choice([16, 32, 64, 128])
    dtype = rng.choice(list(TOLERANCE))
    count = rng.randint(1, 5)
    trees = [random_tree(rng, rng.randint(1, 40), rng.choice(SHAPES)) for _ in range(count)]
    contexts = [rng.randint(0, 300) for _ in range(count)]
    meta, k_cache, v_cache = paged_case(rng, trees, contexts, rng.choice([16, 32, 64]), kv_heads, head_dim, dtype)
    q = torch.randn(meta.num_tokens, num_heads, head_dim).to(DEVICE, dtype)
    assert_matches_reference(q, k_cache, v_cache, meta, dtype)


@pytest.mark.parametrize("shape", SHAPES)
def test_each_tree_shape_alone(shape):
    rng = random.Random(len(shape))
    trees = [random_tree(rng, 20, shape), random_tree(rng, 5, shape)]
    meta, k_cache, v_cache = paged_case(rng, trees, [37, 0], 16, 2, 64, torch.float32)
    q = torch.randn(meta.num_tokens, 8, 64, device=DEVICE)
    assert_matches_reference(q, k_cache, v_cache, meta, torch.float32)


def test_decode_batch_of_single_nodes():
    """The decode case: one node per request, contexts from empty to several blocks."""
    rng = random.Random(5)
    contexts = [0, 1, 16, 33, 128, 299]
    trees = [TokenTree.single(1) for _ in contexts]
    meta, k_cache, v_cache = paged_case(rng, trees, contexts, 16, 2, 128, torch.bfloat16)
    q = torch.randn(meta.num_tokens, 8, 128).to(DEVICE, torch.bfloat16)
    assert_matches_reference(q, k_cache, v_cache, meta, torch.bfloat16)


@pytest.mark.parametrize("size", [65, 100])
def test_trees_beyond_64_nodes_use_the_dense_mask(size):
    rng = random.Random(size)
    trees = [random_tree(rng, size, "random"), random_tree(rng, 30, "deep")]
    meta, k_cache, v_cache = paged_case(rng, trees, [50, 200], 16, 1, 64, torch.float32)
    assert meta.max_tree_len > triton_kernels.BITMASK_MAX_NODES
    q = torch.randn(meta.num_tokens, 4, 64, device=DEVICE)
    assert_matches_reference(q, k_cache, v_cache, meta, torch.float32)


def test_long_prefill_chain_spans_many_query_tiles():
    rng = random.Random(3)
    trees = [TokenTree.chain([1] * 150), TokenTree.single(1)]
    meta, k_cache, v_cache = paged_case(rng, trees, [40, 10], 16, 3, 64, torch.float32)
    q = torch.randn(meta.num_tokens, 9, 64, device=DEVICE)
    assert_matches_reference(q, k_cache, v_cache, meta, torch.float32)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_context_split_across_programs_merges_exactly(num_splits):
    """Flash-decoding: the context is cut into splits whose partial softmaxes are merged.
    Splits can be empty (a short context), and the tree's keys sit in the last one."""
    rng = random.Random(num_splits)
    trees = [TokenTree.single(1), random_tree(rng, 4, "random")]
    meta, k_cache, v_cache = paged_case(rng, trees, [300, 20], 16, 1, 64, torch.float32)
    q = torch.randn(meta.num_tokens, 2, 64, device=DEVICE)
    assert_matches_reference(q, k_cache, v_cache, meta, torch.float32, num_splits=num_splits)


def test_block_size_larger_than_the_key_tile():
    rng = random.Random(11)
    trees = [random_tree(rng, 12, "random"), TokenTree.single(1)]
    meta, k_cache, v_cache = paged_case(rng, trees, [200, 90], 128, 2, 64, torch.float16)
    q = torch.randn(meta.num_tokens, 4, 64).to(DEVICE, torch.float16)
    assert_matches_reference(q, k_cache, v_cache, meta, torch.float16)


def test_head_dim_must_be_a_multiple_of_16():
    meta, k_cache, v_cache = paged_case(random.Random(0), [TokenTree.single(1)], [3], 16, 1, 24, torch.float32)
    with pytest.raises(ValueError, match="divisible by 16"):
        triton_kernels.paged_tree_attention(torch.randn(1, 2, 24, device=DEVICE), k_cache, v_cache, meta, 1.0)


def test_tree_bitmask_sets_ancestor_bits():
    tree = TokenTree((1,) * 5, (-1, 0, 0, 1, 3))
    meta = AttentionMetadata.build([TokenTree.single(1), tree], [4, 9], [[0], [1]], 16)
    assert meta.tree_bitmask.tolist() == [0b1, 0b1, 0b11, 0b101, 0b1011, 0b11011]
    wide = TokenTree((1,) * 64, (-1,) + (0,) * 63)
    last = AttentionMetadata.build([wide], [0], [[0, 1, 2, 3]], 16).tree_bitmask[-1]
    assert int(last) == -(2**63) + 1  # bit 63 is the sign bit, bit 0 the root


def test_a_step_padded_to_a_fixed_size_gives_its_tokens_the_same_attention_and_writes_nothing_for_padding():
    """What a CUDA graph replays: requests of no nodes and tokens of slot -1 added, the launch
    planned for the size's bounds (widest tree, longest context), not for the step."""
    rng = random.Random(21)
    trees = [random_tree(rng, 5, "random"), TokenTree.single(1), TokenTree.chain([1] * 3)]
    meta, k_cache, v_cache = paged_case(rng, trees, [40, 0, 130], 16, 2, 32, torch.float32)
    size = PaddedSize(tokens=16, requests=8, width=8, blocks=meta.block_tables.shape[1] + 2, context=512)
    host, facts = host_tensors(trees, [40, 0, 130], meta.block_tables.tolist(), 16, bitmask=True, pad=size)
    padded = AttentionMetadata.from_host(16, to_device(host, torch.device(DEVICE)), facts)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(size.tokens, 4, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(size.tokens, 2, 32, generator=gen).to(DEVICE) for _ in range(2))
    padded_k, padded_v = k_cache.clone(), v_cache.clone()
    triton_kernels.write_kv(k, v, padded_k, padded_v, padded.slot_mapping)
    out = triton_kernels.paged_tree_attention(q, padded_k, padded_v, padded, 32**-0.5)
    real = meta.num_tokens
    triton_kernels.write_kv(k[:real], v[:real], k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(padded_k, k_cache) and torch.equal(padded_v, v_cache)  # padding wrote nowhere
    expected = triton_kernels.paged_tree_attention(q[:real], k_cache, v_cache, meta, 32**-0.5)
    torch.testing.assert_close(out[:real], expected, atol=1e-5, rtol=1e-5)


# -- Quantized caches ------------------------------------------------------------------------

# The kernel dequantizes what the reference dequantizes and attends in fp32, so it agrees with the
# reference over the dequantized values as over float caches; fp32 gets 5e-5 rather than 1e-5 as
# these keys reach 10x the float tests' (scores 10x larger, their rounding too).
QUANTIZED_TOLERANCE = {torch.float32: 5e-5, torch.bfloat16: 2e-2}


def quantized_case(rng, trees, contexts, block_size, kv_heads, head_dim, cache_dtype):
    meta, k_cache, v_cache = paged_case(rng, trees, contexts, block_size, kv_heads, head_dim, torch.float32)
    if cache_dtype == torch.int8:  # K's scales spread over decades, as real keys' are
        k_cache = k_cache * torch.logspace(-1, 1, k_cache.shape[1], device=DEVICE).view(1, -1, 1, 1)
        return meta, reference.quantize_kv(k_cache), reference.quantize_kv(v_cache)
    return meta, k_cache.to(cache_dtype), v_cache.to(cache_dtype)


def assert_matches_dequantized_reference(q, k_cache, v_cache, meta):
    scale = q.shape[-1] ** -0.5
    out = triton_kernels.paged_tree_attention(q, k_cache, v_cache, meta, scale)
    # A compiled kernel dequantizes into the queries' dtype before its fp32-accumulating products;
    # the interpreter upcasts bf16 (its bf16 arithmetic is wrong) and so dequantizes into fp32.
    rows_dtype = q.dtype if DEVICE == "cuda" else torch.float32
    keys, values = (reference.dequantize_kv(c, rows_dtype).float() for c in (k_cache, v_cache))
    expected = reference.paged_tree_attention(q.float(), keys, values, meta, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    tol = QUANTIZED_TOLERANCE[q.dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("seed", range(10))
def test_int8_caches_over_random_trees_contexts_gqa_ratios_and_block_sizes(seed):
    rng = random.Random(2000 + seed)
    kv_heads = rng.choice([1, 2, 4])
    num_heads = kv_heads * rng.choice([1, 2, 3, 4])
    head_dim = rng.choice([16, 64, 128])
    trees = [random_tree(rng, rng.randint(1, 40), rng.choice(SHAPES)) for _ in range(rng.randint(1, 4))]
    contexts = [rng.randint(0, 300) for _ in trees]
    meta, k8, v8 = quantized_case(rng, trees, contexts, rng.choice([16, 32, 64]), kv_heads, head_dim, torch.int8)
    assert k8.dtype == torch.int8 and k8.shape[-1] == reference.row_width(head_dim, torch.int8)
    q = torch.randn(meta.num_tokens, num_heads, head_dim).to(DEVICE, rng.choice(list(QUANTIZED_TOLERANCE)))
    assert_matches_dequantized_reference(q, k8, v8, meta)


def assert_writes_what_the_reference_writes(k, v, k_cache, v_cache):
    """The kernel's K/V write of 10 tokens (scattered slots) leaves the caches as the reference's does."""
    slots = torch.tensor([95, 0, 17, 18, 40, 41, 42, 63, 64, 80], device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(k, v, expected_k, expected_v, slots)
    triton_kernels.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("seed", range(3))
def test_int8_write_kv_stores_the_references_codes_and_scales(seed):
    """The same bits as `reference.quantize_kv`: attention over caches either one wrote is the same."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, head_dim = 3, 64
    k_cache = reference.quantize_kv(torch.randn(6, 16, kv_heads, head_dim, generator=gen)).to(DEVICE)
    v_cache = reference.quantize_kv(torch.randn(6, 16, kv_heads, head_dim, generator=gen)).to(DEVICE)
    fused = torch.randn(10, 2 * kv_heads, head_dim, generator=gen) * torch.logspace(-3, 2, 10).view(10, 1, 1)
    fused[3, 1] = 0  # a zero row: scale 0, codes 0
    fused[4, 0] = 0  # scale 31.75 / 127 = 0.25 exactly: codes 0.5, -1.5, 2.5 round half to even
    fused[4, 0, :4] = torch.tensor([31.75, 0.125, -0.375, 0.625])
    fused = fused.to(DEVICE)
    assert_writes_what_the_reference_writes(fused[:, :kv_heads], fused[:, kv_heads:], k_cache, v_cache)


def test_int8_compaction_moves_rows_with_their_scales():
    rng = random.Random(9)
    cache = reference.quantize_kv(torch.randn(2, 6, 16, 2, 64) * 10).to(DEVICE)
    s, d = compaction_slots([4, 1], 7, [0] + sorted(rng.sample(range(1, 12), 5)), 16)
    src, dst = torch.tensor(s, device=DEVICE), torch.tensor(d, device=DEVICE)
    expected = cache.clone()
    reference.compact_kv(expected, src, dst)
    triton_kernels.compact_kv(cache, src, dst)
    assert torch.equal(cache, expected)


@pytest.mark.cuda
@pytest.mark.parametrize("seed", range(4))
def test_fp8_caches_over_random_trees(seed):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 (e4m3) needs compute capability 8.9 or newer")
    rng = random.Random(3000 + seed)
    trees = [random_tree(rng, rng.randint(1, 40), rng.choice(SHAPES)) for _ in range(3)]
    contexts = [rng.randint(0, 300) for _ in trees]
    meta, k8, v8 = quantized_case(rng, trees, contexts, 16, 2, 128, torch.float8_e4m3fn)
    q = torch.randn(meta.num_tokens, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    assert_matches_dequantized_reference(q, k8, v8, meta)


@pytest.mark.cuda
def test_fp8_write_kv_rounds_as_torch_does():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.zeros(4, 16, 2, 64, device=DEVICE, dtype=torch.float8_e4m3fn) for _ in range(2))
    k, v = (torch.randn(7, 2, 64, generator=gen).to(DEVICE, torch.bfloat16) * 20 for _ in range(2))
    slots = torch.tensor([0, 5, 16, 17, 33, 50, 63], device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(k, v, expected_k, expected_v, slots)
    triton_kernels.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))


# -- K/V writes and compaction -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_kv_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    kv_heads, head_dim = 3, 64
    k_cache = torch.randn(6, 16, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(6, 16, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    # K and V as the model makes them: views into one fused projection (strided), in fp32
    fused = torch.randn(10, 2 * kv_heads, head_dim, generator=gen).to(DEVICE)
    assert_writes_what_the_reference_writes(fused[:, :kv_heads], fused[:, kv_heads:], k_cache, v_cache)


def test_compaction_matches_reference_across_requests_and_layers():
    """Accepted paths of several requests moved down in one launch, over all layers at once."""
    rng = random.Random(4)
    layers, blocks, block_size, kv_heads, head_dim = 3, 12, 16, 2, 64
    cache = torch.randn(layers, blocks, block_size, kv_heads, head_dim).to(DEVICE)
    src, dst = [], []
    for table, ctx in (([3, 7, 1], 10), ([0, 11], 5), ([5, 2, 9], 20)):
        accepted = [0] + sorted(rng.sample(range(1, 12), rng.randint(1, 6)))
        s, d = compaction_slots(table, ctx, accepted, block_size)
        src += s
        dst += d
    src_t, dst_t = torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE)
    expected = cache.clone()
    reference.compact_kv(expected, src_t, dst_t)
    triton_kernels.compact_kv(cache, src_t, dst_t)
    assert len(src) > 3 and torch.equal(cache, expected)


@pytest.mark.cuda
def test_compaction_reaches_layers_beyond_2_31_elements_of_the_cache():
    """A served model's whole cache (all layers in one tensor) passes 2**31 elements: a layer's
    offset must not wrap around in 32-bit arithmetic (7 GB of GPU memory)."""
    layers, block_size, row = 3, 16, 64
    blocks = (2**31 // (block_size * row)) // 2 + 1  # layer 2 starts past 2**31 elements
    cache = torch.empty(layers, blocks, block_size, 1, row, dtype=torch.bfloat16, device=DEVICE)
    flat = cache.view(layers, blocks * block_size, row)
    src, dst = [blocks * block_size - 5, blocks * block_size - 3], [7, 8]
    moved = torch.randn(layers, 2, row, device=DEVICE).to(torch.bfloat16)
    flat[:, src] = moved
    triton_kernels.compact_kv(cache, torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE))
    assert torch.equal(flat[:, dst], moved)


# -- dispatch ------------------------------------------------------------------------------


def test_cpu_tensors_take_the_cpu_kernels_unless_triton_is_forced(monkeypatch):
    monkeypatch.delenv("SPECSERVE_ATTENTION", raising=False)
    assert ops.backend(torch.device("cpu")) == "cpu"  # fp32 and bf16: the C++ kernel
    assert ops.backend(torch.device("cpu"), torch.float16) == "reference"
    assert ops.backend(torch.device("cuda")) == "triton"
    monkeypatch.setenv("SPECSERVE_ATTENTION", "triton")
    assert ops.backend(torch.device("cpu")) == "triton"
    monkeypatch.setenv("SPECSERVE_ATTENTION", "flash")
    with pytest.raises(ValueError, match="triton, cpu, reference"):
        ops.backend(torch.device("cpu"))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8], ids=str)
def test_forced_triton_runs_the_kernel_through_the_ops(monkeypatch, cache_dtype):
    """int8 caches too: the kernel writes the reference's codes and attends over their values."""
    rng = random.Random(9)
    trees = [random_tree(rng, 6, "random")]
    meta, k_cache, v_cache = quantized_case(rng, trees, [20], 16, 2, 32, cache_dtype)
    q, k, v = (torch.randn(meta.num_tokens, h, 32, device=DEVICE) for h in (4, 2, 2))
    calls = []
    real = triton_kernels.paged_tree_attention
    monkeypatch.setattr(triton_kernels, "paged_tree_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("SPECSERVE_ATTENTION", "triton")
    k_ours, v_ours = k_cache.clone(), v_cache.clone()
    out = ops.tree_attention(q, k, v, k_ours, v_ours, meta, 0.2)
    expected = reference.tree_attention(q, k, v, k_cache, v_cache, meta, 0.2)
    assert calls == [1]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_ours, k_cache) and torch.equal(v_ours, v_cache)
