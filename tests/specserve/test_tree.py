"""TokenTree: the one tree type shared by drafters, attention metadata and verification."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specserve.tree import KEPT_CHAIN_MASKS, TokenTree


@st.composite
def trees(draw, max_nodes: int = 40) -> TokenTree:
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
    return TokenTree(tuple(tokens), tuple(parents))


@given(trees())
def test_ancestor_mask_is_exactly_self_and_ancestors(tree: TokenTree):
    mask = tree.ancestor_mask
    assert mask.shape == (len(tree), len(tree)) and mask.dtype == torch.bool
    for i in range(len(tree)):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(tree.path_to(i))


@given(trees())
def test_the_batch_mask_is_the_ancestor_mask_as_a_batch_of_one(tree: TokenTree):
    assert tree.batch_mask.shape == (1, len(tree), len(tree)) and torch.equal(tree.batch_mask[0], tree.ancestor_mask)


@pytest.mark.parametrize("n", [1, 9, KEPT_CHAIN_MASKS, KEPT_CHAIN_MASKS + 1])
def test_chains_of_a_length_share_one_mask_unless_long(n: int):
    """A draft's or decode's chain mask is kept per length (no tensor op a step); a prompt chunk's is not."""
    first, second = TokenTree.chain(range(n)), TokenTree.chain(range(1, n + 1))
    assert torch.equal(first.batch_mask[0], torch.ones(n, n, dtype=torch.bool).tril())
    assert (first.batch_mask is second.batch_mask) == (n <= KEPT_CHAIN_MASKS)


@given(trees(), st.integers(0, 500))
def test_positions_are_context_len_plus_depth(tree: TokenTree, context_len: int):
    positions = tree.positions(context_len)
    for i in range(len(tree)):
        assert tree.depths[i] == len(tree.path_to(i)) - 1
        assert positions[i] == context_len + tree.depths[i]


@given(trees())
def test_paths_start_at_root_and_follow_parents(tree: TokenTree):
    for i in range(len(tree)):
        path = tree.path_to(i)
        assert path[0] == 0 and path[-1] == i
        assert all(tree.parents[b] == a for a, b in zip(path, path[1:], strict=False))
        assert tree.path_tokens(i) == [tree.tokens[j] for j in path]
    assert set(tree.leaves) == {i for i in range(len(tree)) if not tree.children[i]}


@given(st.lists(st.integers(0, 50), min_size=1, max_size=30))
def test_chain_is_causal(tokens):
    tree = TokenTree.chain(tokens)
    assert tree.is_chain
    assert torch.equal(tree.ancestor_mask, torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril())
    assert list(tree.depths) == list(range(len(tokens)))


@given(st.integers(0, 9), st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), min_size=1, max_size=8))
def test_from_paths_shares_prefixes_and_keeps_every_path(root, paths):
    tree = TokenTree.from_paths(root, paths)
    found = {tuple(tree.path_tokens(i)) for i in range(len(tree))}
    for path in paths:
        assert (root, *path) in found
    # no two siblings carry the same token: shared prefixes are merged
    for kids in tree.children:
        toks = [tree.tokens[k] for k in kids]
        assert len(toks) == len(set(toks))
    distinct_prefixes = {tuple(p[:k]) for p in paths for k in range(1, len(p) + 1)}
    assert len(tree) == 1 + len(distinct_prefixes)


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1, max_size=8), st.integers(0, 12))
def test_from_paths_with_a_node_budget_keeps_earlier_paths_first(paths, tree_budget):
    tree = TokenTree.from_paths(9, paths, tree_budget=tree_budget)
    assert len(tree) - 1 <= tree_budget
    prefixes = {tuple(p[:k]) for p in paths for k in range(1, len(p) + 1)}
    assert all(tuple(tree.path_tokens(i)[1:]) in prefixes for i in range(1, len(tree)))
    first = TokenTree.from_paths(9, paths[:1])
    if len(first) - 1 <= tree_budget:  # the first path always fits whole when it can
        assert tuple([9, *paths[0]]) in {tuple(tree.path_tokens(i)) for i in range(len(tree))}


@pytest.mark.parametrize(
    "tokens, parents",
    [((), ()), ((1, 2), (-1,)), ((1, 2), (0, 0)), ((1, 2, 3), (-1, 2, 1)), ((1, 2), (-1, 1))],
)
def test_invalid_trees_are_rejected(tokens, parents):
    with pytest.raises(ValueError):
        TokenTree(tokens, parents)
