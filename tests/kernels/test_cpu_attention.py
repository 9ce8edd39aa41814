"""The C++ CPU attention: the reference's semantics, and each row computed as if alone."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from kernels import cpu_attention, ops, reference
from kernels.metadata import AttentionMetadata
from kernels.native import isa, library_path
from specserve.tree import TokenTree
from tests.kernels.test_block_matmul import functions_using
from tests.kernels.test_reference import check_against_dense, make_case, paged_cache, random_tree


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_matches_dense_attention(seed, block_size, heads, kv_heads):
    rng = random.Random(seed * 1000 + block_size)
    shapes = [rng.choice(["chain", "single", "random", "deep"]) for _ in range(rng.randrange(1, 5))]
    case = make_case(rng, block_size, heads, kv_heads, 64, shapes, torch.float32)
    check_against_dense(*case, block_size, heads, attention=cpu_attention.tree_attention)


def attend(trees, contexts, tables, k_cache, v_cache, q, block_size=4):
    meta = AttentionMetadata.build(trees, contexts, tables, block_size)
    return cpu_attention.paged_tree_attention(q, k_cache, v_cache, meta, 0.125)


def test_a_tree_node_gets_the_bits_of_the_same_token_decoded_alone():
    """Node 4 of a tree (ancestors 0, 1) sees the keys a decode of it sees after 0 and 1 were
    accepted: its output must be identical, whatever else the step holds."""
    rng = random.Random(3)
    tree = TokenTree((1, 2, 3, 4, 5, 6), (-1, 0, 0, 1, 1, 2))  # node 4's path: 0 -> 1 -> 4
    context = 37
    requests = [(context, tree), (50, random_tree(rng, 7, "random")), (9, TokenTree.single(1))]
    tables, k_cache, v_cache = paged_cache(rng, requests, 4, 2, 64, torch.float32)
    q = torch.randn(sum(len(t) for _, t in requests), 8, 64)
    in_tree = attend([t for _, t in requests], [c for c, _ in requests], tables, k_cache, v_cache, q)[4]
    # The same keys laid out as plain decoding would have them: nodes 0 and 1 accepted, then node 4.
    flat_k, flat_v = k_cache.view(-1, 2, 64), v_cache.view(-1, 2, 64)
    slots = [tables[0][p // 4] * 4 + p % 4 for p in range(context + 6)]
    path = slots[:context] + [slots[context + 0], slots[context + 1], slots[context + 4]]
    alone_k, alone_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    alone_k.view(-1, 2, 64)[: len(path)] = flat_k[path]
    alone_v.view(-1, 2, 64)[: len(path)] = flat_v[path]
    table = list(range(-(-len(path) // 4)))
    alone = attend([TokenTree.single(5)], [len(path) - 1], [table], alone_k, alone_v, q[4:5])[0]
    assert torch.equal(in_tree, alone)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("head_dim", [64, 128, 48])  # the vector paths and the portable loop
def test_bf16_is_the_fp32_arithmetic_on_the_widened_values_rounded_once(seed, head_dim):
    """bf16 queries and caches give what fp32 gives on the same values, rounded to bf16 at the end
    (no bf16 rounding of scores or sums on the way): row-invariant like fp32, and more exact."""
    rng = random.Random(seed)
    requests = [(rng.randrange(0, 90), random_tree(rng, rng.randrange(1, 9), "random")) for _ in range(3)]
    tables, k_cache, v_cache = paged_cache(rng, requests, 16, 2, head_dim, torch.bfloat16)
    q = torch.randn(sum(len(t) for _, t in requests), 6, head_dim).bfloat16()
    trees, contexts = [t for _, t in requests], [c for c, _ in requests]
    got = attend(trees, contexts, tables, k_cache, v_cache, q, block_size=16)
    widened = attend(trees, contexts, tables, k_cache.float(), v_cache.float(), q.float(), block_size=16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, widened.bfloat16())


def test_fp32_and_bf16_cpu_tensors_take_this_kernel_and_fp16_the_reference(monkeypatch):
    monkeypatch.delenv("SPECSERVE_ATTENTION", raising=False)
    assert ops.backend(torch.device("cpu"), torch.float32) == "cpu"
    assert ops.backend(torch.device("cpu"), torch.bfloat16) == "cpu"
    assert ops.backend(torch.device("cpu"), torch.int8) == "cpu"
    assert ops.backend(torch.device("cpu"), torch.float16) == "reference"


def int8_cache(values: torch.Tensor) -> torch.Tensor:
    """A float cache `[..., D]` as int8 cache rows (codes, then a scale byte per 32 channels)."""
    return reference.quantize_kv(values)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("head_dim", [64, 128, 48])  # the vector paths and the portable loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_caches_are_attended_as_their_dequantized_values(seed, head_dim, dtype):
    """Over int8 caches the kernel computes exactly what it computes over the caches' values
    (codes times scales, as the reference dequantizes) held in fp32: same arithmetic, same bits.
    Contexts of up to 200 keys: the kernel widens a long context's rows a run at a time."""
    rng = random.Random(seed)
    requests = [(rng.randrange(0, 200), random_tree(rng, rng.randrange(1, 9), "random")) for _ in range(3)]
    tables, k_cache, v_cache = paged_cache(rng, requests, 16, 2, head_dim, torch.float32)
    k8, v8 = int8_cache(k_cache * 3), int8_cache(v_cache)
    assert k8.dtype == torch.int8 and k8.shape[-1] == reference.row_width(head_dim, torch.int8)
    q = torch.randn(sum(len(t) for _, t in requests), 6, head_dim).to(dtype)
    trees, contexts = [t for _, t in requests], [c for c, _ in requests]
    got = attend(trees, contexts, tables, k8, v8, q, block_size=16)
    values = attend(trees, contexts, tables, reference.dequantize_kv(k8, torch.float32),
                    reference.dequantize_kv(v8, torch.float32), q.float(), block_size=16)
    assert got.dtype == dtype and torch.equal(got, values.to(dtype))


def test_int8_caches_stay_near_the_values_they_quantize():
    """Codes within half a step of each value: a scale per 32 channels, max |x| / 127 rounded up
    to the next of 8 steps per octave (so no more than 1/8 coarser)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.logspace(-3, 1, 50)[:, None, None]
    x[:, :, :32] *= 100  # an outlier half (within the scales' range): the other keeps its own finer scale
    rows = int8_cache(x)
    assert rows.shape[-1] == 66
    step = x.view(50, 3, 2, 32).abs().amax(dim=-1, keepdim=True) / 127
    error = (reference.dequantize_kv(rows, torch.float32) - x).abs().view(50, 3, 2, 32)
    assert (error <= step * 9 / 16).all()
    assert torch.equal(reference.dequantize_kv(int8_cache(torch.zeros(2, 64)), torch.float32), torch.zeros(2, 64))


def test_scale_bytes_round_up_to_eight_steps_per_octave_and_decode_exactly():
    scales = torch.tensor([0.0, 1e-40, 2.0**-23, 1.0, 1.01, 1.125, 1.9999, 240.0, 1e6])
    decoded = reference.decode_scales(reference.encode_scales(scales))
    expected = torch.tensor([0.0, 2.0**-23, 2.0**-23, 1.0, 1.125, 1.125, 2.0, 240.0, 240.0])
    assert torch.equal(decoded, expected)
    valid = torch.cat([torch.zeros(1), torch.arange(8, 256)]).to(torch.uint8)  # exponent 0 only for 0
    assert torch.equal(reference.encode_scales(reference.decode_scales(valid)), valid)


def test_a_tree_node_over_an_int8_cache_gets_the_bits_of_the_same_token_decoded_alone():
    """What makes speculation lossless over int8 caches: a row's result depends on its keys only."""
    rng = random.Random(5)
    tree = TokenTree((1, 2, 3, 4, 5, 6), (-1, 0, 0, 1, 1, 2))
    requests = [(37, tree), (50, random_tree(rng, 7, "random"))]
    tables, k_cache, v_cache = paged_cache(rng, requests, 4, 2, 64, torch.float32)
    k8, v8 = int8_cache(k_cache), int8_cache(v_cache)
    q = torch.randn(sum(len(t) for _, t in requests), 8, 64)
    together = attend([t for _, t in requests], [c for c, _ in requests], tables, k8, v8, q)
    alone = attend([tree], [37], tables[:1], k8, v8, q[: len(tree)])
    assert torch.equal(together[: len(tree)], alone)


@pytest.mark.parametrize("query_dtype, cache_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_queries_attend_over_a_cache_of_another_dtype_as_its_widened_values(query_dtype, cache_dtype):
    """--kv-cache-dtype bf16 under an fp32 model (and fp32 under bf16): the cache's values widened
    exactly, the same fp32 arithmetic, the result in the queries' dtype."""
    rng = random.Random(11)
    requests = [(rng.randrange(0, 90), random_tree(rng, rng.randrange(1, 9), "random")) for _ in range(3)]
    tables, k_cache, v_cache = paged_cache(rng, requests, 16, 2, 64, cache_dtype)
    q = torch.randn(sum(len(t) for _, t in requests), 6, 64).to(query_dtype)
    trees, contexts = [t for _, t in requests], [c for c, _ in requests]
    got = attend(trees, contexts, tables, k_cache, v_cache, q, block_size=16)
    widened = attend(trees, contexts, tables, k_cache.float(), v_cache.float(), q.float(), block_size=16)
    assert got.dtype == query_dtype and torch.equal(got, widened.to(query_dtype))


def test_an_unsupported_cache_dtype_is_refused_with_a_message():
    rng = random.Random(0)
    requests = [(5, TokenTree.single(1))]
    tables, k_cache, v_cache = paged_cache(rng, requests, 4, 2, 64, torch.float16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 queries over float32, bfloat16 or int8 caches"):
        attend([TokenTree.single(1)], [5], tables, k_cache, v_cache, torch.randn(1, 4, 64))


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_the_vector_loops_prefetch_the_keys_and_values_they_read_next():
    # A step's weights evict its K/V, which then arrive cold: without these prefetches 16 decodes
    # over 500 keys took 1.3x as long. GCC has deleted a prefetch-only helper before.
    if isa() == "portable":
        pytest.skip("the portable path has no prefetches")
    # "value_pass" names both vector paths' value loops (value_pass<...> and value_passes<...>)
    functions = functions_using(library_path(), ("scores_of<", "values_of<", "value_pass"), r"vfmadd\d+ps")
    assert functions, "no attention loop found in the library"
    for name, body in functions.items():
        assert "prefetcht2" in body, f"{name} reads K/V rows without prefetching them"
