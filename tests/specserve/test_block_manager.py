"""Block manager: reference counts, prefix caching by content hash, LRU eviction, no leaks."""

from __future__ import annotations

import random

import pytest

from specserve import block_manager as bm
from specserve.block_manager import BlockManager, BlockTable, NoFreeBlocks

BS = 4


def run_prompt(manager: BlockManager, prompt: list[int]) -> BlockTable:
    """What the engine does for a prompt: allocate (sharing the cached prefix), compute the rest, commit."""
    table = manager.allocate(prompt)
    manager.ensure_slots(table, len(prompt))
    manager.commit(table, prompt)
    return table


def test_a_shared_prefix_is_computed_once():
    manager = BlockManager(num_blocks=16, block_size=BS)
    shared = list(range(10))  # two full blocks and a partial one
    first = run_prompt(manager, shared + [100, 101])
    second = manager.allocate(shared + [200, 201, 202])
    assert second.num_cached_tokens == 8 and second.block_ids == first.block_ids[:2]
    assert [manager.ref_counts[b] for b in first.block_ids[:2]] == [2, 2]
    manager.ensure_slots(second, 13)
    assert not set(second.block_ids[2:]) & set(first.block_ids)  # the tails are private
    manager.check_invariants([first, second])


def test_the_block_holding_the_last_prompt_token_is_never_shared():
    manager = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(12))  # exactly three full blocks
    first = run_prompt(manager, prompt)
    again = manager.allocate(prompt)
    assert again.num_cached_tokens == 8  # the last block is recomputed, so it is written privately
    manager.ensure_slots(again, 12)
    assert again.block_ids[2] != first.block_ids[2]
    manager.check_invariants([first, again])


def test_freed_blocks_keep_their_hash_until_evicted():
    manager = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    table = run_prompt(manager, prompt)
    cached_blocks = table.block_ids[:2]
    manager.free(table)
    assert manager.num_free_blocks == 8
    hit = manager.allocate(prompt)
    assert hit.block_ids == cached_blocks and hit.num_cached_tokens == 8
    manager.check_invariants([hit])


def test_eviction_takes_the_least_recently_freed_block_first():
    manager = BlockManager(num_blocks=4, block_size=BS)
    a = run_prompt(manager, [1] * 4 + [0])  # 1 hashed block + 1 private
    b = run_prompt(manager, [2] * 4 + [0])
    manager.free(a)
    manager.free(b)
    fresh = manager.allocate([9] * 3)
    manager.ensure_slots(fresh, 12)  # needs 3 of 4: both unhashed ones, then the oldest cached (a's)
    assert manager.allocate([1] * 4 + [0]).num_cached_tokens == 0  # a's block was evicted
    kept = manager.allocate([2] * 4 + [0])
    assert kept.num_cached_tokens == 4  # b's is still there
    manager.check_invariants([fresh, kept])


def test_running_out_raises_without_taking_anything():
    manager = BlockManager(num_blocks=3, block_size=BS)
    table = manager.allocate([1, 2])
    manager.ensure_slots(table, 8)
    with pytest.raises(NoFreeBlocks):
        manager.ensure_slots(table, 16)
    assert len(table.block_ids) == 2 and manager.num_free_blocks == 1
    manager.check_invariants([table])


def test_hash_collisions_are_not_mistaken_for_hits(monkeypatch):
    monkeypatch.setattr(bm, "block_hash", lambda parent, tokens: 42)
    manager = BlockManager(num_blocks=8, block_size=BS)
    run_prompt(manager, [1, 2, 3, 4, 5])
    assert manager.allocate([9, 9, 9, 9, 5]).num_cached_tokens == 0


def test_without_prefix_caching_nothing_is_shared():
    manager = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    first = run_prompt(manager, list(range(9)))
    second = manager.allocate(list(range(9)))
    assert second.num_cached_tokens == 0 and not second.block_ids
    manager.free(first)
    assert manager.num_free_blocks == 8 and not manager.evictable


def test_commit_must_fit_the_table():
    manager = BlockManager(num_blocks=4, block_size=BS)
    table = manager.allocate([1, 2, 3])
    manager.ensure_slots(table, 3)
    with pytest.raises(ValueError, match="do not fit"):
        manager.commit(table, [1, 2, 3, 4, 5])


@pytest.mark.parametrize("seed", range(25))
def test_random_lifecycles_never_leak(seed):
    """Submits, tree steps with partial acceptance, aborts, preemptions and completions, checked
    after every operation; at the end every block is free or held only by the prefix cache."""
    rng = random.Random(seed)
    manager = BlockManager(num_blocks=rng.randrange(6, 40), block_size=rng.choice([1, 2, 4, 16]))
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 40))] for _ in range(3)]
    live: dict[int, tuple[BlockTable, list[int]]] = {}
    for op in range(300):
        action = rng.random()
        if action < 0.3 or not live:  # a new request, often sharing a prefix
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
            table = manager.allocate(prompt)
            try:
                manager.ensure_slots(table, len(prompt))
            except NoFreeBlocks:
                manager.free(table)  # cannot fit now: give back the shared prefix
            else:
                manager.commit(table, prompt)
                live[op] = (table, prompt)
        elif action < 0.85:  # a verification step: write a tree, accept part of it
            key = rng.choice(list(live))
            table, tokens = live[key]
            tree = rng.randrange(1, 9)
            try:
                manager.ensure_slots(table, len(tokens) + tree)
            except NoFreeBlocks:  # preempted: blocks freed, recomputed later
                manager.free(table)
                del live[key]
            else:
                tokens.extend(rng.randrange(50) for _ in range(rng.randrange(1, tree + 1)))
                manager.commit(table, tokens)
        else:  # finished or aborted
            table, _ = live.pop(rng.choice(list(live)))
            manager.free(table)
        manager.check_invariants(table for table, _ in live.values())
    for table, _ in live.values():
        manager.free(table)
    manager.check_invariants([])
    assert manager.num_free_blocks == manager.num_blocks
    assert all(count == 0 for count in manager.ref_counts)
