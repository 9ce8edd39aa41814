"""Per-step attention metadata: a flat, unpadded batch of token trees over a paged cache.

Built once per forward step from each request's `TokenTree`, `context_len` and block
table, then shared by every layer (and by the draft model's forwards).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch

# A padded path pads each group of requests to its longest tree and its longest sequence, in one
# attention call. What a group costs, in units of one query row attending to one key:
#     PAD_CALL_COST + requests x longest sequence x (PAD_KEY_COST + longest tree).
# A key costs ~9 rows (gathering it from the paged cache and loading it dominate the few
# query rows of a decode), and a call ~8000 (~0.17 ms), as `_padded_attention` measured on a
# 2-core CPU in bf16 (SmolLM2's 9 query and 3 K/V heads, contexts 200-600, 1-64 requests).
# So a tree of 2 nodes among 63 decodes at context 200 gets a call of its own rather than
# padding all of them to 2 rows, while a few trees of similar size share one call.
PAD_KEY_COST = 9
PAD_CALL_COST = 8000


class TreeLike(Protocol):
    """What the metadata needs of a tree (`specserve.tree.TokenTree` satisfies it)."""

    @property
    def depths(self) -> Sequence[int]: ...

    @property
    def ancestor_mask(self) -> torch.Tensor: ...

    @property
    def batch_mask(self) -> torch.Tensor: ...

    @property
    def is_chain(self) -> bool: ...

    def __len__(self) -> int: ...


def chain_masks(lens: torch.Tensor, max_n: int) -> torch.Tensor:
    """[B, max_n, max_n] bool: chain b of `lens[b]` nodes sees itself and every earlier node;
    rows and columns past its length False."""
    index = torch.arange(max_n)
    return (index[None, :, None] >= index[None, None, :]) & (index[None, :, None] < lens[:, None, None])


def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors on `device` in one transfer: their bytes packed into one pinned buffer (the
    widest elements first, each at an offset aligned for its type), copied without blocking,
    then viewed as the tensors again. On the CPU: the tensors themselves."""
    if device.type == "cpu":
        return list(tensors)
    buffer, layout = pack(tensors, pin=True)
    return unpack(buffer.to(device, non_blocking=True), layout)


Layout = list[tuple[int, torch.dtype, tuple[int, ...]]]  # per tensor: byte offset, dtype, shape


def pack(tensors: Sequence[torch.Tensor], pin: bool = False) -> tuple[torch.Tensor, Layout]:
    """The tensors' bytes in one uint8 buffer (`to_device`'s), and where each lies."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    offsets, total = [0] * len(tensors), 0
    for i in order:
        size = tensors[i].element_size()
        total = -(-total // size) * size
        offsets[i] = total
        total += tensors[i].numel() * size
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    for t, offset in zip(tensors, offsets, strict=True):
        nbytes = t.numel() * t.element_size()
        buffer[offset:offset + nbytes] = t.contiguous().reshape(-1).view(torch.uint8)
    return buffer, [(o, t.dtype, tuple(t.shape)) for t, o in zip(tensors, offsets, strict=True)]


def unpack(buffer: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The tensors `pack` laid out, as views of `buffer` (on whatever device it now is)."""
    out = []
    for offset, dtype, shape in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(buffer[offset:offset + nbytes].view(dtype).view(shape))
    return out


def slots_for(block_table: Sequence[int], start: int, count: int, block_size: int) -> list[int]:
    """Physical cache slots of logical positions `start .. start + count - 1`."""
    needed = -(-(start + count) // block_size)
    if needed > len(block_table):
        raise ValueError(
            f"block table has {len(block_table)} blocks of {block_size} slots, but positions up to "
            f"{start + count} need {needed}: allocate more blocks before the step"
        )
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + count)]


HOST_FIELDS = ("query_start_loc", "context_lens", "tree_lens", "block_tables", "slot_mapping", "positions",
               "ancestor_mask")


@dataclass(frozen=True, order=True)
class PaddedSize:
    """Fixed sizes to pad a step to, so that one captured CUDA graph serves every step within them.

    Padding requests have no nodes and padding tokens slot -1 (no request): the Triton kernels
    skip both (the other backends take unpadded steps only). The facts of a padded step are
    these bounds, so the kernels' launch (tiles, mask kind, context splits) is the same for
    every step padded to one size."""

    tokens: int
    requests: int
    width: int  # nodes per tree at most (<= BITMASK_MAX_NODES: the kernel's bitmask)
    blocks: int  # block-table columns
    context: int  # tokens cached per request at most

    def fits(self, tree_lens: Sequence[int], context_lens: Sequence[int], table_lens: Sequence[int]) -> bool:
        return (sum(tree_lens) <= self.tokens and len(tree_lens) <= self.requests and max(tree_lens) <= self.width
                and max(table_lens) <= self.blocks and max(context_lens) <= self.context)


def host_tensors(
    trees: Sequence[TreeLike],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    bitmask: bool = False,
    pad: PaddedSize | None = None,
) -> tuple[list[torch.Tensor], dict]:
    """A step's metadata as host tensors (`HOST_FIELDS`' order, then the tree bitmask where
    `bitmask` asks for it and the trees fit one), and the facts the host knows of it; with
    `pad`, padded to its sizes."""
    if not (len(trees) == len(context_lens) == len(block_tables)) or not trees:
        raise ValueError("need one tree, context_len and block table per request (and at least one)")
    lens = [len(t) for t in trees]
    if pad is not None and not pad.fits(lens, context_lens, [len(bt) for bt in block_tables]):
        raise ValueError(f"a step of {len(trees)} trees of {lens} nodes does not fit {pad}")
    requests = len(trees) if pad is None else pad.requests
    max_n = max(lens) if pad is None else pad.width
    max_blocks = max(len(bt) for bt in block_tables) if pad is None else pad.blocks
    slots: list[int] = []
    positions: list[int] = []
    for tree, ctx, table in zip(trees, context_lens, block_tables, strict=True):
        slots += slots_for(table, ctx, len(tree), block_size)
        positions += [ctx + d for d in tree.depths]
    padding = 0 if pad is None else pad.tokens - len(slots)
    slots += [-1] * padding
    positions += [0] * padding
    missing = requests - len(trees)
    # A few tensor ops per step, not a few per request: a step of 32 decodes made ~160 before.
    tables = torch.tensor([[*table, *[0] * (max_blocks - len(table))] for table in block_tables]
                          + [[0] * max_blocks] * missing, dtype=torch.int64)
    all_lens = lens + [0] * missing
    # The 1-D fields made as one tensor and split into views: each tensor op costs a few
    # microseconds, ten times that right after a CPU forward has streamed the weights through the caches.
    sizes = [requests + 1, requests, requests, len(slots), len(positions)]
    flat = torch.tensor([0, *itertools.accumulate(all_lens), *context_lens, *[0] * missing, *all_lens, *slots,
                         *positions], dtype=torch.int64)
    starts, contexts, tree_lens, slot_mapping, position_ids = flat.split_with_sizes(sizes)  # `split`: a layer more
    if len(trees) == 1 and lens[0] == max_n and not missing:  # batch 1, every step: the tree's own (no op)
        masks = trees[0].batch_mask
    elif max_n == 1 and not missing:  # single tokens (decodes): each sees itself
        masks = torch.ones(requests, 1, 1, dtype=torch.bool)
    else:
        masks = chain_masks(tree_lens, max_n)
        for b, tree in enumerate(trees):
            if not tree.is_chain:
                masks[b, : len(tree), : len(tree)] = tree.ancestor_mask
    host = [starts, contexts, tree_lens, tables, slot_mapping, position_ids, masks]
    if bitmask and max_n <= 64:
        bits = (masks.long() * (torch.ones(max_n, dtype=torch.int64) << torch.arange(max_n))).sum(-1)
        rows = torch.tensor([b * max_n + i for b, n in enumerate(lens) for i in range(n)], dtype=torch.int64)
        host.append(torch.cat([bits.flatten()[rows], torch.zeros(padding, dtype=torch.int64)]))
    if pad is not None:
        facts = {"max_tree_len": pad.width, "max_context_len": pad.context, "max_seq_len": pad.context + pad.width,
                 "is_rectangular": False, "is_fresh_prefill": False, "all_chains": pad.width == 1}
    else:
        all_chains = all(t.is_chain for t in trees)
        facts = {"max_tree_len": max_n, "max_context_len": max(context_lens),
                 "max_seq_len": max(c + n for c, n in zip(context_lens, lens, strict=True)),
                 "is_rectangular": all(n == max_n for n in lens),
                 "is_fresh_prefill": len(trees) == 1 and all_chains and context_lens[0] == 0,
                 "all_chains": all_chains}
    return host, facts


@dataclass(eq=False)
class AttentionMetadata:
    block_size: int
    query_start_loc: torch.Tensor  # [B + 1] int64: request b owns flat tokens [start[b], start[b+1])
    context_lens: torch.Tensor  # [B] int64: tokens already in the cache, attended in full
    tree_lens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0 (masked out)
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    positions: torch.Tensor  # [T] int64: context_len + depth
    ancestor_mask: torch.Tensor  # [B, max_n, max_n] bool, padded with False
    all_chains: bool = False  # every tree is a chain (pure prefill / decode): a causal mask suffices

    @classmethod
    def build(
        cls,
        trees: Sequence[TreeLike],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        device = torch.device(device)
        host, facts = host_tensors(trees, context_lens, block_tables, block_size, bitmask=device.type != "cpu")
        return cls.from_host(block_size, to_device(host, device), facts)

    @classmethod
    def from_host(cls, block_size: int, tensors: Sequence[torch.Tensor], facts: dict) -> AttentionMetadata:
        """Metadata over `host_tensors`' tensors (wherever they now are) and facts."""
        meta = cls(block_size, *tensors[:len(HOST_FIELDS)], all_chains=facts["all_chains"])
        if len(tensors) > len(HOST_FIELDS):
            facts = {**facts, "tree_bitmask": tensors[len(HOST_FIELDS)]}
        # What the host already knows, so that asking never reads back from an accelerator
        meta.__dict__.update({k: v for k, v in facts.items() if k != "all_chains"})  # the cached properties' slots
        return meta

    # -- sizes ----------------------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        return self.context_lens.numel()

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()

    @cached_property
    def is_fresh_prefill(self) -> bool:
        """One request, a chain, nothing cached: plain causal attention over the new tokens."""
        return self.num_requests == 1 and self.all_chains and int(self.context_lens[0]) == 0

    @cached_property
    def max_tree_len(self) -> int:
        return int(self.tree_lens.max())

    @cached_property
    def max_context_len(self) -> int:
        return int(self.context_lens.max())

    @cached_property
    def max_seq_len(self) -> int:
        """Longest `context_len + tree_len`: the keys one request attends to, at most."""
        return int((self.context_lens + self.tree_lens).max())

    @cached_property
    def is_rectangular(self) -> bool:
        """Every request has the same number of new tokens: the flat batch is already padded."""
        return bool((self.tree_lens == self.max_tree_len).all())

    # -- derived index tensors for the padded (reference) path ---------------------------

    @cached_property
    def padded_index(self) -> torch.Tensor:
        """Flat token t of request b, node i -> row `b * max_tree_len + i` of a padded batch."""
        starts = self.query_start_loc[:-1]
        request = torch.repeat_interleave(torch.arange(self.num_requests, device=starts.device), self.tree_lens)
        node = torch.arange(self.num_tokens, device=starts.device) - starts[request]
        return request * self.max_tree_len + node

    @cached_property
    def key_mask(self) -> torch.Tensor:
        """[B, 1, max_n, max_seq_len] bool: cached context in full, then the tree's ancestors."""
        seq = torch.arange(self.max_seq_len, device=self.context_lens.device)
        ctx = self.context_lens[:, None]
        in_context = (seq[None, :] < ctx)[:, None, :]  # [B, 1, L]
        rel = seq[None, :] - ctx  # key j is tree node j - ctx
        in_tree = (rel >= 0) & (rel < self.tree_lens[:, None])
        node = rel.clamp(0, self.max_tree_len - 1)[:, None, :].expand(-1, self.max_tree_len, -1)
        tree_part = torch.gather(self.ancestor_mask, 2, node) & in_tree[:, None, :]
        mask = in_context | tree_part
        # Padding rows see nothing; let them see key 0 so softmax stays finite (output discarded).
        mask[:, :, 0] |= ~mask.any(-1)
        return mask[:, None]

    @cached_property
    def tree_bitmask(self) -> torch.Tensor:
        """[T] int64: bit j of token t is set when tree node j is t's ancestor or t itself.

        The compact tree mask of the Triton kernel for trees of at most 64 nodes. Bit 63 is
        the sign bit; the bits are distinct, so summing them is an OR.
        """
        if self.max_tree_len > 64:
            raise ValueError(f"a bitmask holds trees of at most 64 nodes, this step has {self.max_tree_len}")
        bits = torch.ones(self.max_tree_len, dtype=torch.int64, device=self.ancestor_mask.device)
        bits = bits << torch.arange(self.max_tree_len, device=bits.device)
        per_node = (self.ancestor_mask.long() * bits).sum(-1)  # [B, max_n]
        return per_node.flatten()[self.padded_index]

    def additive_key_mask(self, dtype: torch.dtype, repeats: int = 1, keys: int | None = None) -> torch.Tensor:
        """`key_mask` as 0 / -inf in `dtype`, built once per step instead of once per layer by SDPA.

        With `repeats`, the query axis repeats whole (`[B, 1, repeats * max_n, L]`): the mask of
        query heads folded into the query axis, `repeats` heads per K/V head. With `keys`, the
        key axis is padded to that length, the padding masked."""
        length = keys or self.key_mask.shape[-1]
        cached = self._additive_masks.get((dtype, repeats, length))
        if cached is None:
            shape = (*self.key_mask.shape[:-1], length)
            cached = torch.full(shape, float("-inf"), dtype=dtype, device=self.key_mask.device)
            cached[..., : self.key_mask.shape[-1]].masked_fill_(self.key_mask, 0.0)
            if repeats > 1:
                cached = cached.repeat(1, 1, repeats, 1)
            self._additive_masks[(dtype, repeats, length)] = cached
        return cached

    @cached_property
    def _additive_masks(self) -> dict[tuple[torch.dtype, int, int], torch.Tensor]:
        return {}

    @cached_property
    def padding_groups(self) -> list[tuple[torch.Tensor | None, AttentionMetadata]]:
        """The requests split into groups for a padded path to pad each apart, at the least cost
        (see PAD_CALL_COST): a step's decodes are not padded up to its trees, nor its trees up
        to a long prompt chunk, unless another call costs more than the padding. Per group: its
        flat token indices (None when one group has them all) and its own metadata."""
        lens = self.tree_lens.tolist()
        seq_lens = (self.context_lens + self.tree_lens).tolist()
        order = sorted(range(len(lens)), key=lambda b: -lens[b])
        groups = [order[start:end] for start, end in _cheapest_split([lens[b] for b in order],
                                                                      [seq_lens[b] for b in order])]
        if len(groups) == 1:
            return [(None, self)]
        return [self._select(sorted(group)) for group in groups]

    def _select(self, requests: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        """A subset of the requests as a step of its own: (their flat token indices, metadata)."""
        index = torch.as_tensor(requests, dtype=torch.int64, device=self.tree_lens.device)
        lens = self.tree_lens[index]
        starts = torch.zeros(len(requests) + 1, dtype=torch.int64, device=lens.device)
        starts[1:] = torch.cumsum(lens, 0)
        tokens = torch.cat([torch.arange(int(self.query_start_loc[b]), int(self.query_start_loc[b + 1]),
                                         device=lens.device) for b in requests])
        max_n = int(lens.max())
        meta = AttentionMetadata(
            block_size=self.block_size,
            query_start_loc=starts,
            context_lens=self.context_lens[index],
            tree_lens=lens,
            block_tables=self.block_tables[index],
            slot_mapping=self.slot_mapping[tokens],
            positions=self.positions[tokens],
            ancestor_mask=self.ancestor_mask[index, :max_n, :max_n],
            all_chains=self.all_chains,
        )
        return tokens, meta


def _cheapest_split(tree_lens: list[int], seq_lens: list[int]) -> list[tuple[int, int]]:
    """Requests sorted by tree length (longest first) cut into contiguous groups of the least
    total padded cost: (start, end) per group. Cuts fall only between different tree lengths,
    so a step of a few distinct sizes is a small dynamic program, whatever its batch."""
    runs = [0] + [i for i in range(1, len(tree_lens)) if tree_lens[i] != tree_lens[i - 1]] + [len(tree_lens)]
    run_max_seq = [max(seq_lens[a:b]) for a, b in zip(runs, runs[1:], strict=False)]
    # best[j]: least cost of the first runs[j] requests, and where its last group starts.
    best: list[tuple[float, int]] = [(0.0, 0)]
    for j in range(1, len(runs)):
        longest_seq, options = 0, []
        for i in range(j - 1, -1, -1):  # the last group: runs i .. j-1
            longest_seq = max(longest_seq, run_max_seq[i])
            cost = PAD_CALL_COST + (runs[j] - runs[i]) * longest_seq * (PAD_KEY_COST + tree_lens[runs[i]])
            options.append((best[i][0] + cost, i))
        best.append(min(options))
    cuts, j = [], len(runs) - 1
    while j > 0:
        i = best[j][1]
        cuts.append((runs[i], runs[j]))
        j = i
    return cuts[::-1]


def compaction_slots(
    block_table: Sequence[int], context_len: int, accepted_nodes: Sequence[int], block_size: int
) -> tuple[list[int], list[int]]:
    """Source and destination slots that move an accepted path's K/V to contiguous slots.

    `accepted_nodes` are tree node indices `a_0 = 0 < a_1 < ... < a_m`; node `a_j` was
    written at slot `context_len + a_j` and belongs at `context_len + j`.
    """
    if list(accepted_nodes) != sorted(set(accepted_nodes)):
        raise ValueError(f"accepted nodes must be strictly increasing, got {list(accepted_nodes)}")
    moves = [(a, j) for j, a in enumerate(accepted_nodes) if a != j]
    src = [slots_for(block_table, context_len + a, 1, block_size)[0] for a, _ in moves]
    dst = [slots_for(block_table, context_len + j, 1, block_size)[0] for _, j in moves]
    return src, dst
