"""The torch reference tree attention against a dense masked-softmax computation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kernels.metadata import AttentionMetadata, compaction_slots, slots_for
from kernels.reference import compact_kv, tree_attention
from specserve.tree import TokenTree


def random_tree(rng: random.Random, n: int, shape: str) -> TokenTree:
    if shape == "chain":
        return TokenTree.chain([rng.randrange(100) for _ in range(n)])
    if shape == "single":
        return TokenTree.single(rng.randrange(100))
    parents = [-1] + [rng.randrange(i) if shape == "random" else max(0, i - rng.choice([1, 1, 2])) for i in range(1, n)]
    return TokenTree(tuple(rng.randrange(100) for _ in range(n)), tuple(parents))


def dense_attention(q, keys, values, mask, scale):
    """softmax(q k^T * scale + mask) v in float64, GQA by repeating K/V heads."""
    groups = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(groups, dim=1)
    v = values.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    scores = scores.masked_fill(~mask[None], -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_case(rng: random.Random, block_size: int, heads: int, kv_heads: int, head_dim: int, shapes, dtype):
    """Requests with random contexts already in a shuffled paged cache, plus a tree each."""
    requests = [(rng.randrange(0, 70), random_tree(rng, rng.randrange(1, 12), shape)) for shape in shapes]
    return (requests, *paged_cache(rng, requests, block_size, kv_heads, head_dim, dtype))


def paged_cache(rng: random.Random, requests, block_size: int, kv_heads: int, head_dim: int, dtype):
    """Block tables for (context_len, tree) requests over a shuffled paged cache of random K/V."""
    blocks_needed = [-(-(ctx + len(tree)) // block_size) for ctx, tree in requests]
    num_blocks = sum(blocks_needed) + 3
    order = list(range(num_blocks))
    rng.shuffle(order)  # non-contiguous, interleaved block tables
    tables, used = [], 0
    for count in blocks_needed:
        tables.append(order[used : used + count])
        used += count
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    return tables, k_cache, v_cache


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (8, 2), (4, 1)])
def test_tree_attention_matches_dense(seed, block_size, heads, kv_heads):
    rng = random.Random(seed * 1000 + block_size)
    shapes = [rng.choice(["chain", "single", "random", "deep"]) for _ in range(rng.randrange(1, 5))]
    case = make_case(rng, block_size, heads, kv_heads, 16, shapes, torch.float32)
    check_against_dense(*case, block_size, heads)


def test_decodes_trees_and_prompt_chunks_are_padded_apart():
    """A step mixing decodes, trees and a long chunk is padded in groups of similar length (a
    decode is not padded up to the chunk), and is still exact."""
    rng = random.Random(7)
    block_size, heads, kv_heads = 4, 6, 2
    trees = [TokenTree.single(1), random_tree(rng, 9, "random"), TokenTree.single(2), random_tree(rng, 3, "deep"),
             TokenTree.chain(range(40))]
    contexts = [30, 0, 61, 12, 5]
    requests = list(zip(contexts, trees, strict=True))
    tables, k_cache, v_cache = paged_cache(rng, requests, block_size, kv_heads, 16, torch.float32)

    meta = AttentionMetadata.build(trees, contexts, tables, block_size)
    groups = [sorted(group.tree_lens.tolist()) for _, group in meta.padding_groups]
    assert sorted(groups) == [[1, 1, 3], [9, 40]]
    check_against_dense(requests, tables, k_cache, v_cache, block_size, heads)


def group_sizes(tree_lens: list[int], context_len: int) -> list[list[int]]:
    meta = AttentionMetadata.build([TokenTree.chain(range(n)) for n in tree_lens], [context_len] * len(tree_lens),
                                   [list(range(-(-(context_len + n) // 16))) for n in tree_lens], 16)
    return sorted(sorted(group.tree_lens.tolist()) for _, group in meta.padding_groups)


def test_a_lone_small_tree_gets_a_call_of_its_own_rather_than_padding_a_big_batch_of_decodes():
    assert group_sizes([1] * 63 + [2], 200) == [[1] * 63, [2]]


def test_a_few_trees_of_similar_size_share_one_call_with_the_decodes():
    assert group_sizes([3, 3, 2, 2, 2, 1, 1, 1], 600) == [[1, 1, 1, 2, 2, 2, 3, 3]]


def test_one_group_is_the_whole_step_without_copies():
    meta = AttentionMetadata.build([TokenTree.single(1)] * 4, [100] * 4, [list(range(7))] * 4, 16)
    assert meta.padding_groups == [(None, meta)]


def check_against_dense(requests, tables, k_cache, v_cache, block_size: int, heads: int,
                        attention=tree_attention) -> None:
    """`attention` over `requests` ((context_len, tree) each) equals dense attention per request,
    and writes each step token's K/V at its slot."""
    kv_heads, head_dim = k_cache.shape[-2:]
    old_k, old_v = k_cache.clone(), v_cache.clone()
    trees = [t for _, t in requests]
    meta = AttentionMetadata.build(trees, [c for c, _ in requests], tables, block_size)
    total = sum(len(t) for t in trees)
    q = torch.randn(total, heads, head_dim)
    k = torch.randn(total, kv_heads, head_dim)
    v = torch.randn(total, kv_heads, head_dim)
    scale = head_dim**-0.5
    out = attention(q, k, v, k_cache, v_cache, meta, scale)

    start = 0
    for (ctx, tree), table in zip(requests, tables, strict=True):
        n = len(tree)
        ctx_slots = slots_for(table, 0, ctx, block_size)
        flat_k, flat_v = old_k.view(-1, kv_heads, head_dim), old_v.view(-1, kv_heads, head_dim)
        keys = torch.cat([flat_k[ctx_slots], k[start : start + n]])
        values = torch.cat([flat_v[ctx_slots], v[start : start + n]])
        mask = torch.cat([torch.ones(n, ctx, dtype=torch.bool), tree.ancestor_mask], dim=1)
        expected = dense_attention(q[start : start + n], keys, values, mask, scale)
        torch.testing.assert_close(out[start : start + n].double(), expected, atol=1e-5, rtol=1e-5)
        # the step's own K/V were written at slots context_len + i
        new_slots = slots_for(table, ctx, n, block_size)
        assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[new_slots], k[start : start + n])
        assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[new_slots], v[start : start + n])
        start += n


def test_positions_and_slots_follow_depth_and_tree_order():
    tree = TokenTree((5, 6, 7, 8), (-1, 0, 0, 1))
    meta = AttentionMetadata.build([tree], [10], [[3, 1]], block_size=8)
    assert meta.positions.tolist() == [10, 11, 11, 12]
    assert meta.slot_mapping.tolist() == [1 * 8 + 2, 1 * 8 + 3, 1 * 8 + 4, 1 * 8 + 5]


def test_block_table_too_short_is_a_clear_error():
    with pytest.raises(ValueError, match="allocate more blocks"):
        AttentionMetadata.build([TokenTree.chain([1, 2, 3])], [14], [[0]], block_size=16)


def test_compaction_moves_accepted_path_to_contiguous_slots():
    layers, blocks, block_size, heads, dim = 3, 6, 4, 2, 8
    cache = torch.randn(layers, blocks, block_size, heads, dim)
    table, ctx = [4, 0, 2], 3
    accepted = [0, 2, 5, 6]  # root, then nodes 2, 5, 6 of the tree
    src, dst = compaction_slots(table, ctx, accepted, block_size)
    before = cache.clone().view(layers, -1, heads, dim)
    compact_kv(cache, torch.tensor(src), torch.tensor(dst))
    after = cache.view(layers, -1, heads, dim)
    for j, a in enumerate(accepted):
        (dst_slot,) = slots_for(table, ctx + j, 1, block_size)
        (src_slot,) = slots_for(table, ctx + a, 1, block_size)
        assert torch.equal(after[:, dst_slot], before[:, src_slot])
    untouched = set(range(blocks * block_size)) - set(dst)
    for slot in untouched:
        assert torch.equal(after[:, slot], before[:, slot])


def test_compaction_rejects_unsorted_paths():
    with pytest.raises(ValueError):
        compaction_slots([0], 0, [0, 3, 2], 16)


def test_attention_after_compaction_equals_attention_on_the_path():
    """Verify a tree, keep one path, compact: the cache then reads as if only the path was run."""
    torch.manual_seed(7)
    heads, kv_heads, dim, block_size = 4, 2, 16, 4
    tree = TokenTree((1, 2, 3, 4, 5, 6), (-1, 0, 0, 2, 3, 2))
    table, ctx = [2, 0, 3, 1], 5
    k_cache = torch.randn(4, block_size, kv_heads, dim)
    v_cache = torch.randn(4, block_size, kv_heads, dim)
    q = torch.randn(len(tree), heads, dim)
    k = torch.randn(len(tree), kv_heads, dim)
    v = torch.randn(len(tree), kv_heads, dim)
    meta = AttentionMetadata.build([tree], [ctx], [table], block_size)
    tree_attention(q, k, v, k_cache, v_cache, meta, 0.25)
    path = tree.path_to(4)  # [0, 2, 3, 4]
    src, dst = compaction_slots(table, ctx, path, block_size)
    compact_kv(k_cache, torch.tensor(src), torch.tensor(dst))
    compact_kv(v_cache, torch.tensor(src), torch.tensor(dst))
    # a query attending to ctx + len(path) cached tokens sees exactly context + path
    probe = torch.randn(1, heads, dim)
    probe_k = torch.randn(1, kv_heads, dim)
    probe_v = torch.randn(1, kv_heads, dim)
    meta2 = AttentionMetadata.build([TokenTree.single(0)], [ctx + len(path)], [table], block_size)
    out2 = tree_attention(probe, probe_k, probe_v, k_cache.clone(), v_cache.clone(), meta2, 0.25)
    ctx_slots = slots_for(table, 0, ctx, block_size)
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    keys = torch.cat([flat_k[ctx_slots], k[path], probe_k])
    values = torch.cat([flat_v[ctx_slots], v[path], probe_v])
    expected = dense_attention(probe, keys, values, torch.ones(1, len(keys), dtype=torch.bool), 0.25)
    torch.testing.assert_close(out2.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("n", [1, 5, 37])
def test_fresh_prefill_fast_path_matches_dense(heads, kv_heads, n):
    """A lone chain with nothing cached takes the mask-free causal path; same semantics."""
    torch.manual_seed(n)
    block_size, dim = 4, 16
    table = list(reversed(range(-(-n // block_size))))
    meta = AttentionMetadata.build([TokenTree.chain(list(range(n)))], [0], [table], block_size)
    assert meta.is_fresh_prefill
    k_cache = torch.zeros(len(table), block_size, kv_heads, dim)
    v_cache = torch.zeros(len(table), block_size, kv_heads, dim)
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    out = tree_attention(q, k, v, k_cache, v_cache, meta, 0.3)
    expected = dense_attention(q, k, v, torch.ones(n, n, dtype=torch.bool).tril(), 0.3)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_a_querys_bits_do_not_depend_on_the_keys_others_add():
    """A decode alone, the same decode as the root of a tree (whose nodes add keys after it), and
    the same decode padded into one call with a longer request: bit-identical outputs in bf16,
    at every context length (CPU SDPA would round a partial last block of keys differently)."""
    torch.manual_seed(3)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    table, other = list(range(8)), list(range(8, 24))
    k_cache = torch.randn(24, block_size, kv_heads, dim).bfloat16()
    v_cache = torch.randn(24, block_size, kv_heads, dim).bfloat16()
    q = torch.randn(5, heads, dim).bfloat16()
    k, v = torch.randn(5, kv_heads, dim).bfloat16(), torch.randn(5, kv_heads, dim).bfloat16()

    def attend(trees: list[TokenTree], contexts: list[int], tables: list[list[int]]) -> torch.Tensor:
        """The first query's output (its K/V and the cache the same in every call)."""
        meta = AttentionMetadata.build(trees, contexts, tables, block_size)
        rows = len(meta.slot_mapping)
        return tree_attention(q[:rows], k[:rows], v[:rows], k_cache.clone(), v_cache.clone(), meta, dim**-0.5)[0]

    for ctx in range(1, 100):
        alone = attend([TokenTree.single(1)], [ctx], [table])
        as_root = attend([TokenTree((1, 2, 3, 4, 5), (-1, 0, 0, 1, 2))], [ctx], [table])
        batched = attend([TokenTree.single(1), TokenTree.single(2)], [ctx, ctx + 37], [table, other])
        assert torch.equal(alone, as_root) and torch.equal(alone, batched), f"context {ctx}"
