"""A merged drafter shares each step's node budget between its parts by what their proposals
for that sequence have been worth: the tokens the target would have accepted of each."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from drafters.base import Commit, Draft, Drafter, DraftRequest, Estimates
from drafters.merge import EXPLORE_EVERY, MergedDrafter, agreement, budget_shares, tree_paths
from drafters.ngram import NgramDrafter
from specserve.tree import TokenTree

A, B = [10, 11, 12, 13], [20, 21, 22, 23]


class Fixed(Drafter):
    """Always proposes the same chain."""

    def __init__(self, chain: list[int]):
        self.chain, self.spec = chain, f"fixed-{chain[0]}"

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [Draft(TokenTree.from_paths(r.token_ids[-1], [self.chain[: r.max_depth]], r.tree_budget))
                for r in requests]


def step(merged: MergedDrafter, seq_id: int, tokens: list[int], target: list[int], budget: int = 4) -> TokenTree:
    """One step: a draft for the sequence, then the target commits its next three tokens `target`."""
    tree = merged.propose([DraftRequest(seq_id, tokens, budget, 4)])[0].tree
    tokens += target[:3]
    merged.observe(Commit(seq_id, list(tokens), len(tokens) - 4, {}))
    return tree


def first_chain(tree: TokenTree) -> list[int]:
    return tree_paths(tree)[0]


def test_the_part_whose_guesses_the_target_keeps_gets_the_budget():
    merged = MergedDrafter([Fixed(A), Fixed(B)])
    tokens = [1, 2, 3]
    assert sorted(map(len, tree_paths(step(merged, 0, tokens, B)))) == [2, 2]  # nothing known: an equal split
    for _ in range(6):
        tree = step(merged, 0, tokens, B)
    assert first_chain(tree) == B  # B's whole chain, and first
    assert len(tree) - 1 == 4 and merged.worth(0)[1] > 2.5 > 0.1 > merged.worth(0)[0]


def test_trust_is_kept_per_sequence():
    merged = MergedDrafter([Fixed(A), Fixed(B)])
    for _ in range(6):
        step(merged, 1, [1, 2, 3], A)
        step(merged, 2, [1, 2, 3], B)
    assert first_chain(step(merged, 1, [1, 2, 3], A)) == A
    assert first_chain(step(merged, 2, [1, 2, 3], B)) == B


def test_a_part_left_out_of_the_tree_is_still_measured_and_wins_the_budget_back():
    merged = MergedDrafter([Fixed(A), Fixed(B)])
    tokens = [1, 2, 3]
    for _ in range(6):
        step(merged, 0, tokens, A, budget=4)
    assert first_chain(step(merged, 0, tokens, A, budget=4)) == A  # all four nodes A's: B not in the tree
    for _ in range(4):  # the sequence turns to what B proposes
        tree = step(merged, 0, tokens, B, budget=4)
    assert tree.tokens[1] == B[0] and merged.worth(0)[1] > merged.worth(0)[0]  # B's chain first again


def test_a_new_sequence_starts_from_what_the_parts_were_worth_to_earlier_ones():
    merged = MergedDrafter([Fixed(A), Fixed(B)])
    for seq_id in range(60):
        for _ in range(3):
            step(merged, seq_id, [1, 2, 3], B)
        merged.release(seq_id)
    assert merged.worth(99)[1] > merged.worth(99)[0]
    assert first_chain(merged.propose([DraftRequest(99, [1, 2, 3], 4, 4)])[0].tree) == B


def test_release_forgets_the_sequence():
    merged = MergedDrafter([Fixed(A), Fixed(B)])
    step(merged, 5, [1, 2, 3], B)
    merged.release(5)
    assert merged.worth(5) == merged.overall and not merged._proposed


class Costly(Fixed, Estimates):
    """A fixed chain that takes `seconds` to propose (a head's or a draft model's forwards)."""

    def __init__(self, chain: list[int], seconds: float):
        super().__init__(chain)
        self.seconds, self.asked = seconds, 0

    def propose(self, requests):
        self.asked += len(requests)
        return super().propose(requests)

    def step_cost(self, tree_budget: int) -> float:
        return self.seconds


def paced_step(merged: MergedDrafter, tokens: list[int], target: list[int], token_seconds: float) -> TokenTree:
    """`step` at a going rate of `token_seconds` a token."""
    tree = merged.propose([DraftRequest(0, tokens, 4, 4, token_seconds=token_seconds)])[0].tree
    tokens += target[:3]
    merged.observe(Commit(0, list(tokens), len(tokens) - 4, {}))
    return tree


def test_a_part_that_adds_nothing_worth_its_time_is_asked_ever_more_rarely_to_measure_it_again():
    """A costly part proposing what a free one does adds no token: at 0.1 s a token, its 1 s a
    step is not worth it, so it is asked on the EXPLORE_EVERY-th step, then after twice as many,
    then four times; the merge's cost to the policy is mostly the free part's (nothing)."""
    costly = Costly(A, seconds=1.0)
    merged = MergedDrafter([Fixed(A), costly])
    tokens = [1, 2, 3]
    asked = []
    for _ in range(7 * EXPLORE_EVERY):
        assert first_chain(paced_step(merged, tokens, A, token_seconds=0.1)) == A
        asked.append(costly.asked)
    assert [asked.index(n) + 1 for n in (1, 2, 3)] == [EXPLORE_EVERY, 3 * EXPLORE_EVERY, 7 * EXPLORE_EVERY]
    assert merged.step_cost(4) == 1.0 / (8 * EXPLORE_EVERY)  # explored ever more rarely
    assert merged.propose([DraftRequest(0, tokens, 4, 4)]) and costly.asked == 4  # no going rate: all asked


def test_a_costly_part_whose_guesses_the_target_keeps_is_asked_every_step_once_measured():
    """The free part guesses wrong, the costly one right: each time it is explored its margin
    (three tokens beyond the free part's none, which pays for it) grows, and it is explored
    again as often as at first, until at 0.1 s a token its margin pays its 0.2 s a step."""
    costly = Costly(B, seconds=0.2)
    merged = MergedDrafter([Fixed(A), costly])
    tokens = [1, 2, 3]
    for _ in range(5 * EXPLORE_EVERY):
        paced_step(merged, tokens, B, token_seconds=0.1)
    assert merged.margin(0)[1] > 2.0 > 0.01 > merged.margin(0)[0]
    before = costly.asked
    for _ in range(5):
        assert first_chain(paced_step(merged, tokens, B, token_seconds=0.1)) == B
    assert costly.asked == before + 5


def test_a_merge_of_a_free_part_and_a_part_not_asked_is_worth_the_free_parts_guess():
    """The policy weighs the parts worth asking: while the costly part (no estimate of its own)
    is not worth its time, the merge's estimate is the n-gram guess's, also on the step that
    explores it."""
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    ngram, costly = NgramDrafter(), Costly(A, seconds=1.0)
    merged = MergedDrafter([ngram, costly])
    for _ in range(EXPLORE_EVERY):
        assert merged.acceptance_profile(0, tokens, 3) == ngram.acceptance_profile(0, tokens, 3)
        assert merged.acceptance_bound() == ngram.acceptance_bound()
        merged.propose([DraftRequest(0, tokens, 3, 3, token_seconds=0.1)])
    assert costly.asked == 1  # explored on a step planned by the n-gram guess


def test_shares_follow_worth_and_always_add_up_to_the_budget():
    assert budget_shares(8, [3.0, 1.0]) == [6, 2]
    assert budget_shares(5, [0.0, 0.0, 0.0]) == [2, 2, 1]
    assert budget_shares(7, [2.0, 0.0]) == [7, 0]
    assert all(sum(budget_shares(n, [0.3, 1.7, 0.9])) == n for n in range(20))


def test_agreement_is_the_common_prefix_with_what_was_committed():
    assert agreement([5, 6, 7], [5, 6, 9, 1]) == 2
    assert agreement([5, 6], [5, 6, 9]) == 2
    assert agreement([4], [5]) == 0


def test_merged_paths_share_prefixes_and_keep_within_budget_and_depth():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    merged = MergedDrafter([NgramDrafter(), NgramDrafter(max_ngram=1)])
    tree = merged.propose([DraftRequest(0, tokens, 6, 3)])[0].tree
    assert 1 < len(tree) <= 7 and max(tree.depths) <= 3
    for kids in tree.children:  # no duplicate siblings
        assert len({tree.tokens[k] for k in kids}) == len(kids)
    assert merged.spec == "ngram+ngram"


def test_what_a_merge_is_worth_is_at_least_its_surest_parts_guess():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    parts = [NgramDrafter(), NgramDrafter(max_ngram=1)]
    merged = MergedDrafter(parts)
    profiles = [p.acceptance_profile(0, tokens, 3) for p in parts]
    assert merged.acceptance_profile(0, tokens, 3) == [max(a, b) for a, b in zip(*profiles, strict=True)]
    assert merged.acceptance_bound() == max(p.acceptance_bound() for p in parts)
    # a part with no estimate of its own, at its measured worth: 1 token a step before anything is measured
    assert MergedDrafter([NgramDrafter(), Fixed(A)]).acceptance_profile(0, tokens, 3) == [
        max(a, b) for a, b in zip(profiles[0], [0.5, 0.25, 0.125], strict=True)]
    merged = MergedDrafter([Fixed(B), Fixed(A)])
    for _ in range(8):
        step(merged, 0, [1, 2, 3], A)  # A's chains accepted three tokens a step
    assert merged.acceptance_profile(0, [1, 2, 3], 2) == pytest.approx([0.75, 0.5625], abs=0.02)
