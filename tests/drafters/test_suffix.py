"""Suffix decoding drafts what followed the sequence's end before, in its own tokens and in recent
outputs, as a tree ranked by how often each continuation came, the deeper the longer the match."""

from __future__ import annotations

import random

import numpy as np
import pytest

from drafters import build_drafter, parse_spec, suffix
from drafters.base import Commit, DraftRequest, Ended
from drafters.spec import SUFFIX_CACHE_TOKENS, DrafterSpec
from drafters.suffix import (
    DEPTH_BEYOND_MATCH,
    DEPTH_PER_MATCHED,
    MIN_PROBABILITY,
    SEPARATOR,
    OutputCache,
    SuffixDrafter,
    longest_match,
)


def propose(drafter, tokens, tree_budget=8, max_depth=8, seq_id=0):
    return drafter.propose([DraftRequest(seq_id, tokens, tree_budget, max_depth)])[0].tree


def paths(tree) -> set[tuple[int, ...]]:
    return {tuple(tree.path_tokens(leaf)[1:]) for leaf in tree.leaves}


def found(match) -> tuple[int, list[int]] | None:
    """A match as its length and where its occurrences end (None: none)."""
    return None if match is None else (match.length, match.after.tolist())


def test_the_longest_match_finds_every_occurrence_of_the_longest_suffix_seen_before():
    corpus = np.array([1, 2, 3, 9, 4, 2, 3, 8, 1, 2, 3, 7, 1, 2, 3], dtype=np.int32)
    match = longest_match(corpus, [5, 1, 2, 3])
    assert match.length == 3 and match.after.tolist() == [3, 11]  # "1 2 3" before 9 and 7 (not the query)
    assert longest_match(corpus, [6]) is None


@pytest.fixture(params=["c++", "numpy"])
def search(request, monkeypatch):
    """Each implementation of the search: our C++ op (where the kernels build), numpy elsewhere."""
    if request.param == "numpy":
        monkeypatch.setattr(suffix, "_native_search", lambda: None)
    elif suffix._native_search() is None:
        pytest.skip("the C++ kernels do not build here")
    return request.param


@pytest.mark.parametrize("wide", [0, 3, suffix.WIDE_MATCH])  # where numpy's narrowing hands over to the rest at once
@pytest.mark.parametrize("seed", range(4))
def test_the_longest_match_is_the_longest_suffix_followed_by_a_token_with_all_its_occurrences(seed: int, wide: int,
                                                                                              search, monkeypatch):
    monkeypatch.setattr(suffix, "WIDE_MATCH", wide)
    rng = random.Random(seed)
    for _ in range(300):  # few distinct tokens, separators among them: long and crossing matches
        vocabulary = rng.randint(1, 4)
        corpus = np.array([SEPARATOR if rng.random() < 0.1 else rng.randrange(vocabulary)
                           for _ in range(rng.randint(0, 60))], dtype=np.int32)
        query = [rng.randrange(vocabulary) for _ in range(rng.randint(1, 40))]
        max_match = rng.choice([1, 2, 3, 32])
        expected = None
        for length in range(min(max_match, len(query)), 0, -1):
            after = [i for i in range(length, len(corpus)) if corpus[i] != SEPARATOR
                     and corpus[i - length : i].tolist() == query[-length:]]
            if after:
                expected = (length, after)
                break
        assert found(longest_match(corpus, query, max_match)) == expected


def test_a_match_drafts_what_followed_it_deeper_the_longer_the_match():
    run = list(range(10, 40))  # followed by 30 tokens: only the match's length bounds the depth
    for matched in (1, 2, 3):
        depth = DEPTH_PER_MATCHED * matched + DEPTH_BEYOND_MATCH
        tokens = [*run, 99, *run[:matched]]
        tree = propose(SuffixDrafter(0), tokens, tree_budget=30, max_depth=30)
        assert tree.tokens == (run[matched - 1], *run[matched : matched + depth])
    assert propose(SuffixDrafter(0), [*run, 99, 10, 11], tree_budget=2).tokens == (11, 12, 13)
    tokens = [7, 1, 2, 3, 4, 5, 9, 6, 2, 3]  # "2 3" was followed by "4 5 9 6", then the sequence ends
    assert propose(SuffixDrafter(0), tokens).tokens == (3, 4, 5, 9, 6, 2, 3)


def test_continuations_that_came_more_often_rank_first_and_rare_ones_are_not_drafted():
    def after_1_2(followers):  # "1 2 t" each time, then a token never seen again (matches stay short)
        return [x for i, t in enumerate(followers) for x in (1, 2, t, 100 + i)] + [1, 2]

    tree = propose(SuffixDrafter(0), after_1_2([4] * 12 + [6] + [4] * 12), tree_budget=8, max_depth=2)
    assert tree.tokens == (2, 4) and MIN_PROBABILITY > 1 / 25  # 6 came once in 25
    tree = propose(SuffixDrafter(0), after_1_2([4, 6, 4, 6, 4]), tree_budget=8, max_depth=1)
    assert tree.tokens == (2, 4, 6)  # both often enough, the commoner first


@pytest.mark.parametrize("tree_budget, max_depth", [(0, 5), (1, 5), (3, 1), (5, 2), (16, 16)])
def test_budget_and_depth_are_respected(tree_budget, max_depth):
    rng = random.Random(tree_budget * 31 + max_depth)
    tokens = [rng.randrange(4) for _ in range(300)]
    tree = propose(SuffixDrafter(0), tokens, tree_budget, max_depth)
    assert len(tree) - 1 <= tree_budget and max(tree.depths) <= max_depth
    assert tree.tokens[0] == tokens[-1]
    for kids in tree.children:  # no duplicate siblings
        assert len({tree.tokens[k] for k in kids}) == len(kids)


def test_nothing_to_propose_without_a_match():
    assert propose(SuffixDrafter(), [1, 2, 3, 4]).tokens == (4,)


def test_a_sequence_grown_a_few_tokens_at_a_time_drafts_what_a_fresh_one_does():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(120)]
    grown = SuffixDrafter(0)
    length = 2
    while length < len(tokens):
        length += rng.choice([1, 2, 3, 9, 13])
        a, b = propose(grown, tokens[:length], seq_id=1), propose(SuffixDrafter(0), tokens[:length], seq_id=1)
        assert (a.tokens, a.parents) == (b.tokens, b.parents)


def test_an_ended_output_is_drafted_from_by_later_sequences_unless_kept_out():
    drafter = SuffixDrafter()
    output = [40, 41, 42, 43, 44, 45, 46, 47]
    drafter.ended(Ended(seq_id=1, prompt_ids=[9, 9], output_ids=output))
    assert propose(drafter, [5, 6, 41, 42, 43], seq_id=2).tokens == (43, 44, 45, 46, 47)  # to the output's end
    kept_out = SuffixDrafter()
    kept_out.ended(Ended(seq_id=1, prompt_ids=[9, 9], output_ids=output, shared=False))
    assert propose(kept_out, [5, 6, 41, 42, 43], seq_id=2).tokens == (43,)
    alone = SuffixDrafter(0)  # suffix:0 keeps no outputs
    alone.ended(Ended(seq_id=1, prompt_ids=[9, 9], output_ids=output))
    assert propose(alone, [5, 6, 41, 42, 43], seq_id=2).tokens == (43,)


def test_a_merge_passes_ended_outputs_on_to_its_suffix_part():
    merged = build_drafter("ngram+suffix")
    merged.ended(Ended(seq_id=1, prompt_ids=[9], output_ids=[40, 41, 42, 43]))
    assert merged.drafters[1].cache.tokens == 4


def test_the_sequence_and_the_cache_are_drafted_from_together_the_longer_match_first():
    drafter = SuffixDrafter()
    drafter.ended(Ended(1, [], [1, 2, 3, 50, 51, 52]))
    tokens = [2, 3, 60, 61, 1, 2, 3]  # the cache matches 3 tokens, the sequence 2
    assert paths(propose(drafter, tokens, seq_id=2)) == {(50, 51, 52), (60, 61, 1, 2, 3)}
    assert propose(drafter, tokens, tree_budget=3, seq_id=2).tokens == (3, 50, 51, 52)  # 3/5 of the weight
    phrase = [*range(20, 30), 3]  # the sequence matches 11 tokens, the cache 1 ("3"): 1/12 of the weight
    assert propose(drafter, [*phrase, 40, 41, 42, *phrase], seq_id=3).tokens == (3, 40, 41, 42, *phrase[:5])


def test_the_cache_keeps_at_most_its_token_limit_and_forgets_the_least_recently_used():
    cache = OutputCache(max_tokens=250)
    for key in range(4):  # 100 tokens each: the first two go
        cache.add(key, list(range(key * 1000, key * 1000 + 100)))
        assert cache.tokens <= 250
    assert [key in cache for key in range(4)] == [False, False, True, True]
    cache.used(longest_match(cache.corpus, [2050]).after)  # output 2 drafted from: used after output 3
    cache.add(4, list(range(4000, 4100)))
    assert [key in cache for key in range(5)] == [False, False, True, False, True]
    assert longest_match(cache.corpus, [3050]) is None  # forgotten outputs are never matched
    assert longest_match(cache.corpus, [2050]).length == 1


def test_the_cache_packs_itself_and_stays_searchable():
    cache = OutputCache(max_tokens=64)
    rng = random.Random(1)
    for key in range(200):
        cache.add(key, [rng.randrange(10_000) for _ in range(20)])
        assert cache.tokens <= 64 and len(cache.corpus) <= 2 * 64 + 2 * 21
    last = cache.corpus[-21:-1].tolist()
    match = longest_match(cache.corpus, last[:5])
    assert match.length == 5 and cache.corpus[match.after[-1]] == last[5]
    cache.add(7, [1, 2])  # a key kept again replaces what it held
    cache.add(7, [3, 4])
    assert cache.tokens <= 64 and longest_match(cache.corpus, [1]) is None


@pytest.mark.parametrize("index_tail", [0, 100, suffix.INDEX_TAIL])  # how often its index is sorted again
@pytest.mark.parametrize("seed", range(3))
def test_the_cache_finds_what_a_scan_of_what_it_holds_finds_as_outputs_come_go_and_are_packed(seed: int,
                                                                                              index_tail: int,
                                                                                              search, monkeypatch):
    monkeypatch.setattr(suffix, "INDEX_TAIL", index_tail)
    rng = random.Random(seed)
    cache = OutputCache(max_tokens=80)
    for step in range(300):
        if rng.random() < 0.1:
            cache.forget(rng.randrange(step + 1))
        else:  # few distinct tokens: long matches, many occurrences; keys come again
            cache.add(rng.randrange(step + 1), [rng.randrange(6) for _ in range(rng.randint(1, 30))])
        query = [rng.randrange(6) for _ in range(rng.randint(1, 12))]
        assert found(cache.match(query)) == found(longest_match(cache.corpus, query))


def test_guesses_are_scored_so_long_matches_that_agree_are_worth_more():
    rng = random.Random(0)
    phrase = list(range(100, 120))
    tokens = []
    for _ in range(12):
        tokens += [rng.randrange(50) for _ in range(30)] + phrase
    drafter = SuffixDrafter(0)
    for length in range(1, len(tokens) + 1):  # as the engine: a commit, then the policy asks
        drafter.observe(Commit(0, tokens[:length], length - 1, {}))
        drafter.acceptance_profile(0, tokens[:length], 1)
    confident = drafter.acceptance_profile(1, [*phrase[:9], 7, *phrase[:9], 8, *phrase[:8]], 4)  # as in the phrase
    doubtful = drafter.acceptance_profile(2, [7, 8, 9, 7], 4)
    assert confident[0] > 0.9 and confident[3] > 0.5 and doubtful[0] < 0.5
    assert all(np.diff(confident) <= 0) and list(drafter.acceptance_profile(3, [1, 2, 3], 2)) == [0, 0]


def test_release_forgets_a_sequence_and_gauges_show_what_it_holds():
    drafter = SuffixDrafter(1000)
    propose(drafter, [1, 2, 1, 2], seq_id=5)
    drafter.ended(Ended(5, [1], [2, 3, 4]))
    drafter.release(5)
    assert 5 not in drafter._sequences
    gauges = drafter.gauges()
    assert gauges["suffix_cache_tokens"] == 3 and gauges["suffix_cache_outputs"] == 1
    assert gauges["suffix_sequence_bytes"] == 0 and gauges["suffix_cache_bytes"] > 0


def test_specs_name_the_cache_size():
    assert parse_spec("suffix") == [DrafterSpec("suffix")]
    assert parse_spec(f"suffix:{SUFFIX_CACHE_TOKENS}") == [DrafterSpec("suffix")]
    assert parse_spec("suffix:0+ngram")[0] == DrafterSpec("suffix", "0")
    assert build_drafter("suffix:4096").cache.max_tokens == 4096 and build_drafter("suffix").spec == "suffix"
    with pytest.raises(ValueError, match="suffix:TOKENS"):
        parse_spec("suffix:lots")
