"""Prompt lookup proposes what followed the sequence's last tokens earlier, within the budget."""

from __future__ import annotations

import random

import numpy as np
import pytest

from drafters.base import Commit, DraftRequest
from drafters.ngram import NgramDrafter


def propose(drafter, tokens, tree_budget=8, max_depth=8, seq_id=0):
    return drafter.propose([DraftRequest(seq_id, tokens, tree_budget, max_depth)])[0].tree


def test_the_longest_match_continues_as_a_chain():
    tokens = [7, 1, 2, 3, 4, 5, 9, 2, 3]  # "2 3" was followed by "4 5 9"
    tree = propose(NgramDrafter(), tokens, tree_budget=3, max_depth=3)
    assert tree.tokens == (3, 4, 5, 9) and tree.is_chain


def test_several_matches_branch_and_share_prefixes():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]  # "1 2" was followed by 3 and by 4
    tree = propose(NgramDrafter(), tokens, tree_budget=4, max_depth=2)
    roots_children = {tree.tokens[c] for c in tree.children[0]}
    assert roots_children == {3, 4}  # most recent match (4) first, then 3
    assert tree.tokens[1] == 4


def test_nothing_to_propose_without_a_match():
    tree = propose(NgramDrafter(), [1, 2, 3, 4])
    assert len(tree) == 1 and tree.tokens == (4,)


@pytest.mark.parametrize("tree_budget, max_depth", [(0, 5), (1, 5), (3, 1), (5, 2), (16, 16)])
def test_budget_and_depth_are_respected(tree_budget, max_depth):
    rng = random.Random(tree_budget * 31 + max_depth)
    tokens = [rng.randrange(4) for _ in range(200)]
    tree = propose(NgramDrafter(), tokens, tree_budget, max_depth)
    assert len(tree) - 1 <= tree_budget and max(tree.depths) <= max_depth
    assert tree.tokens[0] == tokens[-1]


def test_incremental_index_equals_a_fresh_one():
    """A sequence's tokens kept for search a few at a time (a step's) or many at once (a
    prompt's, or those since a busy server's last look) find what a fresh sequence finds."""
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(80)]
    incremental = NgramDrafter()
    length = 2
    while length < len(tokens):
        length += rng.choice([1, 2, 3, 9, 13])  # a step's tokens, or a prompt's
        grown = propose(incremental, tokens[:length], seq_id=1)
        fresh = propose(NgramDrafter(), tokens[:length], seq_id=1)
        assert (grown.tokens, grown.parents) == (fresh.tokens, fresh.parents)


def test_a_match_is_whole_tokens_not_bytes_that_straddle_two():
    """Tokens are searched as bytes (4 per token): 256 = 00 01 00 00 and 1 = 01 00 00 00, so the
    bytes of [256, 0] contain those of [1] one byte in, which is no occurrence of token 1."""
    tree = propose(NgramDrafter(max_ngram=1), [256, 0, 5, 1], tree_budget=4, max_depth=4)
    assert len(tree) == 1
    tree = propose(NgramDrafter(max_ngram=1), [1, 7, 256, 0, 5, 1], tree_budget=4, max_depth=1)
    assert tree.tokens == (1, 7)  # the real occurrence, found past the straddling more recent one


def test_release_forgets_a_sequence():
    drafter = NgramDrafter()
    propose(drafter, [1, 2, 1, 2], seq_id=5)
    drafter.release(5)
    assert 5 not in drafter._indexes


def test_small_budgets_go_to_the_best_matchs_chain():
    tokens = [1, 2, 3, 5, 1, 2, 4, 6, 1, 2]  # "1 2" was followed by "4 6" and by "3 5"
    assert propose(NgramDrafter(), tokens, tree_budget=2, max_depth=2).tokens == (2, 4, 6)
    assert propose(NgramDrafter(), tokens, tree_budget=4, max_depth=2).tokens == (2, 4, 6, 3, 5)


def grow(drafter, tokens, seq_id=0, start=1):
    """Let the sequence commit `tokens` one by one, as the engine does: each step the policy asks
    what the guess at the sequence's end is worth, and the drafter is told of the commit after."""
    for length in range(start, len(tokens) + 1):
        drafter.observe(Commit(seq_id, tokens[:length], length - 1, {}))
        drafter.acceptance_profile(seq_id, tokens[:length], 1)


def test_guesses_are_scored_against_what_followed_whether_verified_or_not():
    """A phrase that comes back (3-token matches come true) amid random tokens (1-token matches
    mostly do not): the drafter learns which of its guesses are worth verifying."""
    rng = random.Random(0)
    phrase = list(range(100, 120))
    tokens = []
    for _ in range(12):
        tokens += [rng.randrange(50) for _ in range(30)] + phrase
    drafter = NgramDrafter()
    grow(drafter, tokens)
    # A 3-token match whose three latest occurrences agree, and a 1-token match seen once.
    confident = drafter.acceptance_profile(1, [*phrase[:5], 7, *phrase[:5], 8, *phrase[:5], 9, *phrase[:3]], 4)
    doubtful = drafter.acceptance_profile(2, [7, 8, 9, 7], 4)
    assert confident[0] > 0.9 and confident[3] > 0.5
    assert doubtful[0] < 0.2
    assert all(np.diff(confident) <= 0) and all(np.diff(doubtful) <= 0)  # P(first k all come true)
    assert drafter.acceptance_bound() == pytest.approx(max(confident[0], doubtful[0]))  # the surest kind's


def test_asking_what_a_guess_is_worth_changes_no_answer():
    """Planning reads the estimates: what a guess is worth depends on the commits so far, not on
    how often or in what order the policy asked (only commits score guesses)."""
    phrase = [5, 6, 7, 8]
    tokens = [*phrase, 1, *phrase, 2, *phrase, 3, *phrase[:2], 9, *phrase]
    once, often = NgramDrafter(), NgramDrafter()
    for length in range(1, len(tokens) + 1):
        for drafter in (once, often):
            drafter.observe(Commit(0, tokens[:length], length - 1, {}))
        often.acceptance_profile(1, [*phrase, 4, *phrase[:3]], 4)  # another sequence first, and repeatedly
        asked = [often.acceptance_profile(0, tokens[:length], 4) for _ in range(3)]
        assert asked == [once.acceptance_profile(0, tokens[:length], 4)] * 3
        assert often.acceptance_bound() == once.acceptance_bound()
    assert once.acceptance_bound() > 0.5  # the guesses asked about were scored: 3-token matches came true


def test_guesses_are_made_where_asked_not_at_every_commit():
    """A busy server's policy seldom looks: commits alone make no guess, so cost no search."""
    tokens = [1, 2, 3, 9] * 6
    silent, asked = NgramDrafter(), NgramDrafter()
    for length in range(1, len(tokens) + 1):
        silent.observe(Commit(0, tokens[:length], length - 1, {}))
    grow(asked, tokens)
    assert silent.acceptance_bound() == 0.5 and asked.acceptance_bound() > 0.5  # unscored: a coin flip


def test_a_sequence_not_observed_yet_is_judged_by_the_guess_it_would_get():
    drafter = NgramDrafter()
    grow(drafter, [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 9])  # 3-token matches came true
    observed = drafter.acceptance_profile(0, [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 9], 2)
    assert drafter.acceptance_profile(7, [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 9], 2) == observed
    assert list(drafter.acceptance_profile(8, [4, 5, 6], 2)) == [0, 0]  # nothing to match


def test_an_unscored_kind_of_match_is_a_coin_flip_and_no_match_is_worth_nothing():
    drafter = NgramDrafter()
    assert drafter.acceptance_profile(0, [1, 2, 3, 1, 2], 2) == pytest.approx([0.5, 0.25])
    assert list(drafter.acceptance_profile(1, [1, 2, 3, 4], 3)) == [0, 0, 0]


def test_a_guess_still_coming_true_when_its_sequence_ends_counts_for_what_it_reached():
    drafter = NgramDrafter()
    grow(drafter, [5, 6, 7, 8, 5, 6, 7], seq_id=3, start=5)  # guesses "7 8 5 6 7": right so far
    drafter.release(3)
    assert drafter.acceptance_profile(4, [1, 2, 3, 1, 2], 1)[0] > 0.5  # its 2-token match's guess came true
