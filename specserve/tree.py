"""The one data model: every forward step runs a *token tree* per request.

A prefill chunk is a chain, a decode step is a single node, and a verification step is
the last emitted token (the root) plus the drafted tree. Drafters build `TokenTree`s,
the attention metadata is derived from them, and verification walks them — so this
module is the single definition of parents, depths, positions, ancestor masks and paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, cached_property

import torch

KEPT_CHAIN_MASKS = 128  # chains up to this long share one kept mask per length (drafts, decodes)


@dataclass(frozen=True, eq=False)
class TokenTree:
    """Tokens in topological order with parent indices (`parents[0] == -1`, `parents[i] < i`)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) == 0:
            raise ValueError("a TokenTree needs at least one node (the root)")
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"tokens ({len(self.tokens)}) and parents ({len(self.parents)}) differ in length")
        if self.parents[0] != -1:
            raise ValueError("parents[0] must be -1: node 0 is the root")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"parents[{i}] = {p}: every parent must precede its child (0 <= parent < i)")

    # -- constructors ---------------------------------------------------------------------

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> TokenTree:
        """A prefill chunk (or a drafted chain): node i's parent is i - 1."""
        tokens = tuple(int(t) for t in tokens)
        return cls(tokens, tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def single(cls, token: int) -> TokenTree:
        """A plain decode step."""
        return cls((int(token),), (-1,))

    @classmethod
    def from_paths(cls, root: int, paths: Sequence[Sequence[int]], tree_budget: int | None = None) -> TokenTree:
        """Merge token paths hanging off `root` into one tree, sharing common prefixes.

        With `tree_budget`, paths are taken in order until the tree has that many nodes besides
        the root; the path that does not fit is cut short.
        """
        tokens, parents = [int(root)], [-1]
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        limit = len(tokens) + (tree_budget if tree_budget is not None else sum(len(p) for p in paths))
        for path in paths:
            node = 0
            for tok in path:
                key = (node, int(tok))
                if key not in children:
                    if len(tokens) >= limit:
                        break
                    children[key] = len(tokens)
                    tokens.append(int(tok))
                    parents.append(node)
                node = children[key]
        return cls(tuple(tokens), tuple(parents))

    # -- structure ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node; the root has depth 0."""
        depths = [0] * len(self)
        for i in range(1, len(self)):
            depths[i] = depths[self.parents[i]] + 1
        return tuple(depths)

    def positions(self, context_len: int) -> list[int]:
        """RoPE position of each node: `context_len + depth`."""
        return [context_len + d for d in self.depths]

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """`mask[i, j]` is True when j is i itself or one of its ancestors ([n, n] bool; read only:
        a short chain's is shared by every chain of its length). Built in Python, one tensor op:
        a tensor op per node cost a tree of 9 nodes ~0.2 ms right after a CPU forward."""
        return self.batch_mask[0]

    @cached_property
    def batch_mask(self) -> torch.Tensor:
        """`ancestor_mask` as a batch of one, [1, n, n] (read only: a short chain's is kept for its
        length): a step of this tree alone takes it as its masks without an op of its own."""
        n = len(self)
        if self.is_chain:  # a prompt chunk's is made afresh: kept for every length, they would add up to GBs
            return (_kept_causal_mask if n <= KEPT_CHAIN_MASKS else _causal_mask)(n)
        rows: list[list[bool]] = []
        for i, p in enumerate(self.parents):
            row = list(rows[p]) if p >= 0 else [False] * n
            row[i] = True
            rows.append(row)
        return torch.tensor([rows], dtype=torch.bool)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return tuple(tuple(k) for k in kids)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path_to(node)]

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i, kids in enumerate(self.children) if not kids)


def _causal_mask(n: int) -> torch.Tensor:
    """A chain's `batch_mask`: the lower triangle of n x n, [1, n, n]."""
    return torch.ones(1, n, n, dtype=torch.bool).tril_()


_kept_causal_mask = cache(_causal_mask)  # one per short length, shared, so never written
