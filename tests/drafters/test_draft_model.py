"""Draft models: what a large vocabulary's LM head scores unless told (FR-Spec's frequent tokens),
and what they propose."""

from __future__ import annotations

import pytest
import torch

from drafters.base import DraftRequest, DraftTarget
from drafters.draft_model import DraftModelDrafter
from specserve.kv_cache import KVCache
from specserve.model_runner import ModelRunner, TreeRequest
from specserve.tree import TokenTree


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, make_tiny_checkpoint):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), vocab_size=300, eos_token_id=299, bos_token_id=0)


def scored(drafter: DraftModelDrafter) -> set[int] | None:
    ids = drafter.model.output_ids
    return None if ids is None else set(ids.tolist())


def frequent(ids: set[int], about: int, special: set[int]) -> bool:
    """The lowest ids, about `about` of them within a tile of 16 rows, and the special tokens."""
    plain = ids - special
    return (special <= ids and plain == set(range(max(plain) + 1)) - special
            and about - 16 < len(ids) <= about + len(special) and len(ids) % 16 == 0)


def test_a_vocabulary_over_twice_the_default_scores_the_default_number_of_tokens(draft_dir):
    drafter = DraftModelDrafter.load(str(draft_dir), None, default_vocab=100)
    assert frequent(scored(drafter), 100, {0, 299})  # the first ~100 ids and the special tokens


def test_a_vocabulary_within_twice_the_default_is_scored_whole(draft_dir):
    assert scored(DraftModelDrafter.load(str(draft_dir), None, default_vocab=150)) is None


def test_a_vocabulary_asked_for_wins_over_the_default(draft_dir):
    assert frequent(scored(DraftModelDrafter.load(str(draft_dir), None, vocab=200, default_vocab=100)), 200, {0, 299})
    assert scored(DraftModelDrafter.load(str(draft_dir), None, vocab=10_000, default_vocab=100)) is None


def test_an_int4_draft_runs_requantized_blocks_and_other_quantizations_are_refused(draft_dir):
    assert DraftModelDrafter.load(str(draft_dir), None, quantization="int4").model.weight_format() == \
        "requantized blocks int4"
    # the blocks compute in fp32 beside a bf16 target (the draft's K/V are its own)
    assert DraftModelDrafter.load(str(draft_dir), torch.bfloat16, quantization="int4").model.dtype == torch.float32
    with pytest.raises(ValueError, match="use int8, int4 or none"):
        DraftModelDrafter.load(str(draft_dir), None, quantization="int2")


def greedy_continuation(model, prompt: list[int], count: int) -> list[int]:
    """The draft model's own greedy tokens, each from a fresh forward of the whole sequence."""
    tokens = list(prompt)
    for _ in range(count):
        cache = KVCache.for_model(model.config, 8, 16, model.dtype)
        logits = ModelRunner(model, cache).forward([TreeRequest(TokenTree.chain(tokens), 0, range(8), "last")])
        tokens.append(int(logits[0].logits[-1].argmax()))
    return tokens[len(prompt):]


def test_a_chain_draft_is_the_draft_models_greedy_continuation_step_after_step(draft_dir):
    drafter = DraftModelDrafter.load(str(draft_dir), None, top_k=1, beam=1)
    drafter.attach(DraftTarget(runner=None, num_blocks=8, block_size=16, vocab_size=300))
    rows = []
    forward = drafter.runner.forward
    drafter.runner.forward = lambda requests: rows.append([len(r.tree) for r in requests]) or forward(requests)
    tokens = [5, 17, 42, 9, 120, 7]
    # (accepted nodes, tokens decoded without drafting after the step's bonus token)
    steps = [(2, []), (1, [3, 250]), (0, []), (4, []), (0, [])]
    new_tokens = len(tokens)  # what the next step's first forward must run: the prompt at first
    for accepted, plain in steps:
        request = DraftRequest(seq_id=1, token_ids=tokens, tree_budget=4, max_depth=4, block_table=range(8),
                               shape="chain")
        rows.clear()
        chain = drafter.propose([request])[0].tree
        assert chain.is_chain and len(chain) == 5
        assert list(chain.tokens[1:]) == greedy_continuation(drafter.model, tokens, 4)
        # accepted nodes were run as they were drafted (all but the last); a chain grows by its newest node
        assert rows == [[new_tokens]] + [[1]] * 3
        drafted = list(chain.tokens[1:])
        bonus = (drafted[accepted] + 1) % 300 if accepted < 4 else 11  # a token the draft did not guess
        tokens = tokens + drafted[:accepted] + [bonus] + plain
        new_tokens = (accepted == 4) + 1 + len(plain)
