"""`replay:ALPHA`: drafts that follow a recorded continuation with probability ALPHA per token,
so speculation's system cost can be measured at a chosen acceptance, on any weights."""

from __future__ import annotations

import pytest

from drafters import build_drafter, parse_spec
from drafters.base import DraftRequest
from drafters.replay import ReplayDrafter
from drafters.spec import DrafterSpec
from specserve.llm import LLM
from specserve.sampling import SamplingParams

TRUTH = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
PROMPT = [1, 2, 3]


def drafter(alpha: float, width: int = 1) -> ReplayDrafter:
    d = ReplayDrafter(alpha, seed=1, width=width)
    d.vocab_size = 100
    d.record(PROMPT + TRUTH)
    return d


def request(token_ids, budget: int = 8, depth: int = 8, seq_id: int = 0) -> DraftRequest:
    return DraftRequest(seq_id=seq_id, token_ids=list(token_ids), tree_budget=budget, max_depth=depth)


def test_the_spec_names_an_acceptance_in_zero_to_one():
    assert parse_spec("replay:0.8") == [DrafterSpec("replay", "0.8")]
    assert isinstance(build_drafter("replay:0.6"), ReplayDrafter)
    for bad in ("replay", "replay:1.5", "replay:high"):
        with pytest.raises(ValueError, match=r"replay:ALPHA needs an acceptance ALPHA in \[0, 1\]"):
            parse_spec(bad)


def test_alpha_one_drafts_the_recorded_continuation_and_zero_drafts_none_of_it():
    sure = drafter(1.0).propose([request(PROMPT + TRUTH[:2], budget=5, depth=4)])[0].tree
    assert sure.tokens == tuple(TRUTH[1:6]) and sure.is_chain  # the root, then the next four
    never = drafter(0.0).propose([request(PROMPT + TRUTH[:2], budget=5, depth=4)])[0].tree
    assert len(never) == 5 and all(never.tokens[k] != TRUTH[1 + k] for k in range(1, 5))


def test_a_sequence_with_no_known_continuation_gets_no_draft_and_a_zero_estimate():
    d = drafter(0.8)
    unknown = [1, 2, 4]
    assert len(d.propose([request(unknown)])[0].tree) == 1
    assert list(d.acceptance_profile(0, unknown, 3)) == [0.0, 0.0, 0.0]
    assert list(d.acceptance_profile(1, PROMPT + TRUTH[:10], 3)) == pytest.approx([0.8, 0.64, 0.0])  # 2 left


def test_drafts_stop_at_the_end_of_what_is_known_and_within_budget_and_depth():
    d = drafter(1.0)
    assert len(d.propose([request(PROMPT + TRUTH[:-3], budget=8, depth=8)])[0].tree) == 1 + 3
    assert len(d.propose([request(PROMPT, budget=2, depth=8)])[0].tree) == 1 + 2
    assert len(d.propose([request(PROMPT, budget=8, depth=3)])[0].tree) == 1 + 3


def test_trees_add_leaf_siblings_of_which_at_most_one_per_level_is_the_true_token():
    d = drafter(0.5, width=3)
    for seq in range(50):
        tree = d.propose([request(PROMPT, budget=7, depth=4, seq_id=seq)])[0].tree
        assert len(tree) == 8  # the budget, spent on the shallowest levels first
        levels: dict[int, list[int]] = {}
        for node in range(1, len(tree)):
            levels.setdefault(tree.depths[node], []).append(node)
        for depth, nodes in levels.items():
            tokens = [tree.tokens[n] for n in nodes]
            assert tokens.count(TRUTH[depth - 1]) <= 1 and len(set(tokens)) == len(tokens)
            assert all(not tree.children[n] for n in nodes[1:])  # siblings are leaves; the spine goes on


def test_continuations_recorded_from_a_run_replay_at_the_set_acceptance_with_unchanged_outputs(dummy_model):
    """The first pass knows nothing, so it is a run without speculation (no drafted token); the
    second replays it: the same tokens, and per drafted token an acceptance within 0.03 of ALPHA
    over more than 2,000 drafted tokens."""
    directory = dummy_model()
    prompts = [[3 + i, 40 + 7 * i, 90 + i] for i in range(12)]
    greedy = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    for alpha in (0.6, 0.8):
        llm = LLM(str(directory), draft=f"replay:{alpha}", load_format="dummy", device="cpu", dtype="float32",
                  kv_cache_memory="64MiB", speculation="fixed", max_tree_tokens=8)
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert llm.engine.metrics.spec.drafted_tokens == 0
        replayed = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert replayed == plain
        spec = llm.engine.metrics.spec
        assert spec.drafted_tokens > 2000
        measured = spec.accepted_tokens / (spec.accepted_tokens + spec.rejections)
        assert measured == pytest.approx(alpha, abs=0.03)


def test_the_oldest_recordings_are_forgotten_past_the_limit(monkeypatch):
    import drafters.replay as replay

    monkeypatch.setattr(replay, "MAX_RECORDED", 3)
    d = ReplayDrafter(1.0)
    for first in range(5):
        d.record([first, 50, 51, 52])
    assert d.continuation(0, [0, 50]) == () and d.continuation(1, [1, 50]) == ()
    assert d.continuation(2, [4, 50]) == (51, 52)
    assert sum(len(v) for v in d._book.values()) == 3 * 4  # each kept sequence under its 4 prefixes
