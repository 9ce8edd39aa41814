"""Paged KV blocks: per-request block tables, reference counts, prefix caching.

Rules:

* Full blocks of *committed* tokens are content-hashed -- hash of the parent block's hash and
  the block's token ids -- and shared between requests with reference counts.
* A request only ever writes past its committed tokens: into its last, partial block and into
  blocks appended for the step's tree. Those blocks are private (never hashed while being
  written), so sharing never needs copy-on-write.
* A freed block keeps its hash and stays findable until it is evicted, least recently freed
  first, when a fresh block is needed.
* Every block is either free (with or without a hash) or referenced by live tables:
  `check_invariants` asserts it.

The draft model's K/V use the same block tables, so this one manager accounts for both.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class NoFreeBlocks(RuntimeError):
    """The pool cannot supply the blocks asked for; the scheduler preempts or waits."""


@dataclass
class BlockTable:
    """The blocks one request owns, in logical order, and how far they are hashed."""

    block_ids: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks whose content hash is known (shared or registered)
    last_hash: int | None = None  # hash of block num_hashed_blocks - 1: the parent of the next one
    num_cached_tokens: int = 0  # tokens found in the prefix cache at allocation (not computed again)

    def num_slots(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Content hash of a full block: its parent's hash and its token ids (deterministic across runs)."""
    return hash((parent, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks
        self.tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # guards against hash collisions
        self.cached: dict[int, int] = {}  # content hash -> block id
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # unhashed, popped from the end
        self.evictable: OrderedDict[int, None] = OrderedDict()  # hashed, unreferenced, oldest first

    # -- accounting ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request could get now: never-used/cleared ones plus evictable cached ones."""
        return len(self.free_ids) + len(self.evictable)

    def blocks_needed(self, table: BlockTable, num_slots: int) -> int:
        """New blocks `table` needs to cover `num_slots` slots (context + this step's tree)."""
        return max(0, -(-num_slots // self.block_size) - len(table.block_ids))

    # -- lifecycle ------------------------------------------------------------------------------

    def allocate(self, token_ids: Sequence[int]) -> BlockTable:
        """A new table for a prompt, sharing every cached full block of its prefix.

        At least the last prompt token is always computed (its logits start generation), so a
        block holding it is never taken from the cache: that block will be written.
        """
        table = BlockTable()
        if not self.enable_prefix_caching:
            return table
        for index in range((len(token_ids) - 1) // self.block_size):
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            h = block_hash(table.last_hash, tokens)
            block = self.cached.get(h)
            if block is None or self.tokens[block] != tokens:
                break
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
            table.block_ids.append(block)
            table.num_hashed_blocks += 1
            table.last_hash = h
        table.num_cached_tokens = table.num_hashed_blocks * self.block_size
        return table

    def ensure_slots(self, table: BlockTable, num_slots: int) -> None:
        """Append private blocks until `table` covers `num_slots` slots, or raise NoFreeBlocks."""
        needed = self.blocks_needed(table, num_slots)
        if needed > self.num_free_blocks:
            raise NoFreeBlocks(f"need {needed} blocks, {self.num_free_blocks} free")
        for _ in range(needed):
            table.block_ids.append(self._take_fresh_block())

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_tokens: int | None = None) -> None:
        """Record that the first `num_tokens` of `token_ids` (default: all) are in the cache:
        every block they now fill is hashed and becomes findable by other requests."""
        num_tokens = len(token_ids) if num_tokens is None else num_tokens
        if num_tokens > table.num_slots(self.block_size) or num_tokens > len(token_ids):
            raise ValueError(f"{num_tokens} committed tokens do not fit the table's "
                             f"{table.num_slots(self.block_size)} slots")
        if not self.enable_prefix_caching:
            return
        while (table.num_hashed_blocks + 1) * self.block_size <= num_tokens:
            index = table.num_hashed_blocks
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            h = block_hash(table.last_hash, tokens)
            block = table.block_ids[index]
            if h not in self.cached:  # an identical block cached elsewhere stays the one others find
                self.cached[h] = block
                self.hashes[block] = h
                self.tokens[block] = tokens
            table.num_hashed_blocks += 1
            table.last_hash = h

    def free(self, table: BlockTable) -> None:
        """Release a finished, aborted or preempted request's blocks (tail first, so a shared
        prefix outlives the private tail in the LRU order)."""
        for block in reversed(table.block_ids):
            self._release(block)
        table.block_ids.clear()
        table.num_hashed_blocks = 0
        table.last_hash = None

    def trim(self, table: BlockTable, num_slots: int) -> None:
        """Give back tail blocks beyond `num_slots` slots (e.g. those a rejected draft used)."""
        keep = max(-(-num_slots // self.block_size), table.num_hashed_blocks)
        while len(table.block_ids) > keep:
            self._release(table.block_ids.pop())

    # -- internals ------------------------------------------------------------------------------

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] < 0:
            raise RuntimeError(f"block {block} freed more often than it was referenced")
        if self.ref_counts[block] == 0:
            if self.hashes[block] is not None:
                self.evictable[block] = None
            else:
                self.free_ids.append(block)

    def _take_fresh_block(self) -> int:
        if self.free_ids:
            block = self.free_ids.pop()
        else:  # evict the least recently freed cached block
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.hashes[block]]
            self.hashes[block] = None
            self.tokens[block] = None
        self.ref_counts[block] = 1
        return block

    def check_invariants(self, live_tables: Iterable[BlockTable]) -> None:
        """Every block is free, evictable, or referenced exactly as often as live tables hold it."""
        held = [0] * self.num_blocks
        for table in live_tables:
            for block in table.block_ids:
                held[block] += 1
        free, evictable = set(self.free_ids), set(self.evictable)
        assert len(free) == len(self.free_ids), "a block is on the free list twice"
        assert not free & evictable, "a block is both free and evictable"
        for block in range(self.num_blocks):
            assert self.ref_counts[block] == held[block], (
                f"block {block}: ref count {self.ref_counts[block]} but held by {held[block]} live tables")
            unreferenced = held[block] == 0
            assert unreferenced == (block in free or block in evictable), f"block {block} is leaked or double-booked"
            assert (block in evictable) <= (self.hashes[block] is not None), f"evictable block {block} has no hash"
        for h, block in self.cached.items():
            assert self.hashes[block] == h, f"cache entry for block {block} is stale"
