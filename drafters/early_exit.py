"""Self-speculation by early exit: the target's first K layers, then its final norm and LM head.

No extra weights and no extra cache: the draft forwards write the target's own K/V for
layers < K at the tree's slots (which the verification forward then rewrites with the same
values), and the committed context those layers attend to is already there. A trained head
in place of the target's norm + LM head: `early-exit:trained` (`drafters/heads.py`).
"""

from __future__ import annotations

import torch

from drafters.base import DraftTarget
from drafters.tree_search import TreeSearchDrafter, _Search
from specserve.model_runner import ModelRunner


class EarlyExitDrafter(TreeSearchDrafter):
    def __init__(self, num_layers: int | None = None, top_k: int = 4, beam: int = 4):
        super().__init__(top_k, beam)
        self.num_layers = num_layers  # None: half the target's layers, decided at attach()
        self.spec = "early-exit" if num_layers is None else f"early-exit:{num_layers}"
        self.runner: ModelRunner | None = None

    def attach(self, target: DraftTarget) -> None:
        total = target.runner.model.config.num_layers
        layers = self.num_layers or max(1, total // 2)
        if not 0 < layers < total:
            raise ValueError(f"{self.spec}: the target has {total} layers; early exit needs K in [1, {total - 1}]")
        self.num_layers, self.runner, self.vocab_size = layers, target.runner, target.vocab_size

    def _forward(self, searches: list[_Search]) -> list[torch.Tensor]:
        outputs = self.runner.forward([self._tree_request(s) for s in searches], num_layers=self.num_layers)
        return [o.logits for o in outputs]
