"""A merged drafter shares each step's node budget between its parts by what their proposals
for that sequence have been worth: the tokens the target would have accepted of each."""

from __future__ import annotations

from collections.abc import Sequence

from drafters.base import Commit, Draft, Drafter, DraftRequest
from drafters.merge import MergedDrafter, agreement, budget_shares, tree_paths
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
    assert MergedDrafter([NgramDrafter(), Fixed(A)]).acceptance_profile(0, tokens, 3) is None  # a part with none
