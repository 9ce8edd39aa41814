"""The one proposer interface: a step's requests in, one token tree per request out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specserve.tree import TokenTree


@dataclass
class DraftRequest:
    """What a drafter sees of one sequence in a step."""

    seq_id: int  # stable for the sequence's life: drafters may keep per-sequence state under it
    token_ids: Sequence[int]  # prompt + output; the last token is the tree's root (not yet in the cache)
    max_nodes: int  # drafted nodes allowed besides the root
    max_depth: int  # longest root-to-leaf run of drafted nodes


@dataclass
class Draft:
    """A proposed tree (root = the request's last token) and, for every node whose children
    were *sampled* from a draft distribution (without replacement), that distribution.
    Children of nodes without an entry are deterministic proposals."""

    tree: TokenTree
    probs: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_drafted(self) -> int:
        return len(self.tree) - 1


class Drafter(ABC):
    """Proposes token trees. Implementations: n-gram lookup, draft models, early exit, merges."""

    spec: str  # the spec string that builds this drafter (see `drafters.spec`)

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One draft per request, within each request's `max_nodes` and `max_depth`."""

    def release(self, seq_id: int) -> None:  # noqa: B027 - stateless drafters need nothing
        """Forget per-sequence state (the sequence finished or was aborted)."""
