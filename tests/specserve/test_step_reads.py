"""A step reads the model's device at most twice (the emitted tokens with the accepted paths,
and log-probabilities when asked), however many sequences and tree nodes it verifies: on a GPU
every read is a synchronisation. Counted by patching every way a tensor reaches the host."""

from __future__ import annotations

import traceback
from collections.abc import Sequence

import pytest
import torch

from drafters import Draft, Drafter, DraftRequest
from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.sampling import SamplingParams
from specserve.tree import TokenTree

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class FixedTreeDrafter(Drafter):
    """A host-side drafter: the same branching shape every step (two children at the root, two
    under the first), tokens drawn from the request's own history."""

    spec = "fixed-tree"

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for r in requests:
            history = list(r.token_ids[-8:])
            tokens = (r.token_ids[-1], history[0], history[1 % len(history)], history[-1], history[-2 % len(history)])
            tree = TokenTree(tokens[: r.tree_budget + 1], (-1, 0, 0, 1, 1)[: r.tree_budget + 1])
            drafts.append(Draft(tree))
        return drafts


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    engine = LLMEngine(tiny_chat_model, dtype="float32",
                       config=EngineConfig(draft="ngram", speculation="fixed", max_tree_tokens=4))
    engine.drafter = FixedTreeDrafter()
    return engine


@pytest.fixture
def reads(monkeypatch):
    """Host reads of tensors, with where they came from."""
    seen: list[str] = []
    for name in READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            seen.append(f"{_name} at {traceback.extract_stack(limit=2)[0]}")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True,
                                                   repetition_penalty=1.2)], ids=["greedy", "sampled"])
def test_a_step_of_16_branching_trees_reads_the_device_at_most_twice(engine, reads, params):
    for i in range(16):
        engine.add_request(f"{params.temperature}-{i}", [1, 2, 3, 4, 5 + i, 6, 7, 8 + i], params)
    verifying_steps = 0
    while engine.has_unfinished():
        reads.clear()
        before = engine.metrics.spec.verify_steps
        engine.step()
        assert len(reads) <= 2, "\n".join(reads)  # prefill steps too
        verifying_steps += engine.metrics.spec.verify_steps > before
    assert verifying_steps >= 3
