"""Model drafters grow trees best-first by draft probability, within budget and depth;
sampled trees keep exactly a without-replacement draw per node, with its distribution."""

from __future__ import annotations

import math

import pytest
import torch

from drafters.base import DraftRequest
from drafters.tree_search import TreeSearchDrafter

VOCAB = 6


class TableDrafter(TreeSearchDrafter):
    """A 'model' whose next-token logits depend only on the current token (a Markov table)."""

    def __init__(self, table: torch.Tensor, **options):
        super().__init__(**options)
        self.table, self.spec, self.vocab_size, self.frontiers = table, "table", VOCAB, []

    def attach(self, target) -> None:  # its table is its whole model
        pass

    def _forward(self, searches):
        self.frontiers.append([len(s.frontier) for s in searches])
        return [self.table[[s.tokens[n] for n in s.frontier]] for s in searches]


def confident_table() -> torch.Tensor:
    """Token t is followed by t + 1 with probability ~0.9, anything else rarely."""
    logits = torch.full((VOCAB, VOCAB), -4.0)
    for t in range(VOCAB):
        logits[t, (t + 1) % VOCAB] = 2.0
    return logits


def request(tree_budget: int, max_depth: int | None = None, **kwargs) -> DraftRequest:
    return DraftRequest(0, [3, 1, 0], tree_budget, tree_budget if max_depth is None else max_depth, **kwargs)


def test_a_chain_follows_the_argmax_for_the_whole_budget():
    drafter = TableDrafter(confident_table(), top_k=1, beam=1)
    (draft,) = drafter.propose([request(5)])
    assert draft.tree.is_chain and draft.tree.tokens == (0, 1, 2, 3, 4, 5)
    assert drafter.forwards == 5 and not draft.probs  # the last node is a leaf: never forwarded


def test_a_confident_draft_grows_deep_and_an_unsure_one_wide():
    deep = TableDrafter(confident_table(), top_k=4, beam=4)
    (draft,) = deep.propose([request(6)])
    assert max(draft.tree.depths) >= 4, "confident paths beat long-shot siblings"
    flat = TableDrafter(torch.zeros(VOCAB, VOCAB), top_k=4, beam=4)  # uniform: every child 1/6
    (draft,) = flat.propose([request(6)])
    assert len(draft.tree.children[0]) == 4 and max(draft.tree.depths) == 2


def test_nodes_are_the_most_likely_paths_and_respect_budget_and_depth():
    torch.manual_seed(0)
    table = torch.randn(VOCAB, VOCAB) * 2
    logq = torch.log_softmax(table, -1)
    for budget, depth in [(1, 1), (4, 2), (7, 3), (12, 12)]:
        (draft,) = TableDrafter(table, top_k=3, beam=2).propose([request(budget, depth)])
        tree = draft.tree
        assert len(tree) - 1 == budget and max(tree.depths) <= depth
        for node in range(1, len(tree)):  # children come from their parent's top-3
            parent = tree.parents[node]
            assert tree.tokens[node] in logq[tree.tokens[parent]].topk(3).indices.tolist()
        # best-first: the root's most likely child is always in the tree
        assert int(logq[0].argmax()) in [tree.tokens[c] for c in tree.children[0]]


def test_a_round_buys_a_layer_of_candidates_and_the_draft_keeps_the_likeliest():
    """EAGLE-2: two forwards (root, then its 4 children) yield 4 + 16 candidates, of which the
    best 12 make the tree: the tree is wider than the rounds it took."""
    table = torch.zeros(VOCAB, VOCAB)
    table[:, 2] = 1.0  # token 2 a little likelier after anything
    drafter = TableDrafter(table, top_k=4, beam=4, max_rounds=2)
    (draft,) = drafter.propose([request(12)])
    tree = draft.tree
    assert drafter.forwards == 2 and len(tree) - 1 == 12
    assert len(tree.children[0]) == 4 and max(tree.depths) == 2
    logq = torch.log_softmax(table, -1)
    score = {n: sum(float(logq[tree.tokens[tree.parents[m]], tree.tokens[m]]) for m in tree.path_to(n)[1:])
             for n in range(1, len(tree))}
    left_out = float(logq[0, 0] + logq[0, 0])  # a grandchild path through two unlikely tokens
    assert min(score.values()) >= left_out - 1e-6, "only the likeliest candidates are kept"


def test_a_request_picks_a_chain_a_level_by_level_tree_or_the_dynamic_tree():
    flat = torch.zeros(VOCAB, VOCAB)  # uniform: the dynamic tree stays shallow and wide
    drafter = TableDrafter(flat, top_k=4, beam=4)
    (chain,) = drafter.propose([request(6, shape="chain")])
    assert chain.tree.is_chain and chain.num_drafted == 6, "a chain as long as asked, however unsure"
    (short,) = drafter.propose([request(6, max_depth=3, shape="chain")])
    assert short.tree.is_chain and short.num_drafted == 3
    (tree,) = drafter.propose([request(6, shape="tree", top_k=2)])
    assert sorted(tree.tree.depths[1:]) == [1, 1, 2, 2, 2, 2] and len(tree.tree.children[0]) == 2
    (wide,) = drafter.propose([request(6, top_k=6)])  # dynamic, with the request's top-k
    assert len(wide.tree.children[0]) == 6


def test_a_round_runs_only_while_its_tokens_are_worth_its_time():
    drafter = TableDrafter(confident_table(), top_k=1, beam=1)
    for _ in range(3):  # as if measured: a growth round takes 0.1 s
        drafter._round_times.add(0.1)
    (cheap,) = drafter.propose([request(6, token_seconds=0.05)])  # a round buys < 1 token: worth < 0.1 s
    assert drafter.forwards == 1 and cheap.num_drafted == 1
    (dear,) = drafter.propose([request(6, token_seconds=1.0)])  # each round buys ~0.99 tokens worth ~1 s
    assert drafter.forwards == 1 + 6 and dear.tree.is_chain and dear.num_drafted == 6
    assert drafter.rounds_per_step is not None and drafter.step_cost(6) > drafter.step_cost(1) > 0


def test_every_request_of_a_step_shares_each_draft_forward():
    drafter = TableDrafter(confident_table(), top_k=1, beam=1)
    drafts = drafter.propose([request(3), request(1), request(0)])
    assert [d.num_drafted for d in drafts] == [3, 1, 0]
    assert drafter.frontiers == [[1, 1], [1], [1]]  # no forward for the empty budget


def test_sampled_children_are_a_draw_without_replacement_with_their_distribution():
    table = torch.zeros(VOCAB, VOCAB)
    table[:, 0] = 3.0  # token 0 is likely after anything
    drafter = TableDrafter(table, top_k=3, beam=1)
    generator = torch.Generator().manual_seed(0)
    (draft,) = drafter.propose([request(5, temperature=0.7, generator=generator)])
    tree = draft.tree
    assert len(tree) - 1 == 5
    for node, q in draft.probs.items():
        kids = [tree.tokens[c] for c in tree.children[node]]
        assert len(set(kids)) == len(kids), "without replacement"
        assert q.shape == (VOCAB,) and math.isclose(float(q.sum()), 1.0, rel_tol=1e-5)
        torch.testing.assert_close(q, torch.softmax(table[tree.tokens[node]] / 0.7, -1))
    assert all(tree.children[n] == () or n in draft.probs for n in range(len(tree)))
    # the first child of the root is token 0 about as often as q says
    hits = 0
    for seed in range(400):
        (d,) = TableDrafter(table, top_k=3, beam=1).propose(
            [request(3, temperature=0.7, generator=torch.Generator().manual_seed(seed))])
        hits += d.tree.tokens[d.tree.children[0][0]] == 0
    q0 = float(torch.softmax(table[0] / 0.7, -1)[0])
    assert abs(hits / 400 - q0) < 4 * math.sqrt(q0 * (1 - q0) / 400)


class SubsetDrafter(TableDrafter):
    """The table's logits over a draft vocabulary only: column j scores token `column_tokens[j]`."""

    def __init__(self, table: torch.Tensor, column_tokens: list[int], **options):
        super().__init__(table, **options)
        self.column_tokens = torch.tensor(column_tokens)

    def _forward(self, searches):
        return [rows[:, self.column_tokens] for rows in super()._forward(searches)]


def test_a_draft_vocabulary_drafts_its_columns_tokens_and_samples_with_q_over_the_whole_vocabulary():
    table = confident_table()
    subset = [5, 1, 2, 3, 4]  # token 0 is not in it
    (greedy,) = SubsetDrafter(table, subset, top_k=1, beam=1).propose([request(3)])
    assert greedy.tree.tokens == (0, 1, 2, 3)  # token ids, not columns
    (sampled,) = SubsetDrafter(table, subset, top_k=2, beam=1).propose(
        [request(4, temperature=1.0, generator=torch.Generator().manual_seed(1))])
    for node, q in sampled.probs.items():
        assert q.shape == (VOCAB,) and float(q[0]) == 0.0  # off the draft vocabulary: never drafted
        expected = torch.zeros(VOCAB)
        expected[subset] = torch.softmax(table[sampled.tree.tokens[node], subset], -1)
        torch.testing.assert_close(q, expected)
    assert 0 not in sampled.tree.tokens[1:]


def test_an_unattached_drafter_says_so():
    drafter = TableDrafter(confident_table())
    drafter.vocab_size = None
    with pytest.raises(RuntimeError, match="never attached"):
        drafter.propose([request(2)])
