"""The one proposer interface: a step's requests in, one token tree per request out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specserve.tree import TokenTree

if TYPE_CHECKING:
    from pathlib import Path

    from specserve.model_runner import ModelRunner
    from specserve.models.config import ModelConfig


@dataclass
class DraftRequest:
    """What a drafter sees of one sequence in a step."""

    seq_id: int  # stable for the sequence's life: drafters may keep per-sequence state under it
    token_ids: Sequence[int]  # prompt + output; the last token is the tree's root (not yet in the cache)
    tree_budget: int  # drafted nodes allowed besides the root
    max_depth: int  # longest root-to-leaf run of drafted nodes
    # Where the sequence's K/V live: node i of the tree goes to slot len(token_ids) - 1 + i, and
    # the scheduler reserved slots up to len(token_ids) - 1 + tree_budget (drafters with a cache use them).
    block_table: Sequence[int] = ()
    temperature: float = 0.0  # the request's: 0 means propose deterministically (greedy verification)
    generator: torch.Generator | None = None  # the request's, so seeded requests stay reproducible
    # What one emitted token is worth at this step's going rate (seconds per token of the plan
    # the speculation policy chose; None: no estimate). A drafter spends no more than that.
    token_seconds: float | None = None
    # The request's tree shape for model drafters (`SpeculationParams.tree`, `.top_k`; None: the
    # drafter's own: dynamic, its top-k).
    shape: str | None = None
    top_k: int | None = None


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
    """Proposes token trees. Implementations: n-gram lookup, draft models, early exit, heads, merges.

    The interface is `propose` and `release`; what else a drafter does, it says by the small
    protocols below (`UsesTarget`, `OwnsKV`, `Observes`, `Estimates`), which the engine and the
    speculation policy look for."""

    spec: str  # the spec string that builds this drafter (see `drafters.spec`)

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One draft per request, within each request's `tree_budget` and `max_depth`."""

    def release(self, seq_id: int) -> None:  # noqa: B027 - stateless drafters need nothing
        """Forget per-sequence state (the sequence finished, was aborted or was preempted)."""

    def gauges(self) -> dict[str, float]:
        """What it holds now, by name (`/metrics` shows each as a gauge): memory it bounds, say."""
        return {}


class UsesTarget(ABC):
    """Drafts with the target's runner or pool (early exit, draft models, heads)."""

    @abstractmethod
    def attach(self, target: DraftTarget) -> None:
        """Called once by the engine when its KV pool exists, before the first `propose`."""


class OwnsKV(UsesTarget):
    """Keeps K/V of its own, indexed by the shared block tables (the pool is sized with them)."""

    @abstractmethod
    def kv_bytes_per_block(self, block_size: int, target: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of the drafter's K/V per block, for a target of that shape and dtype."""


@dataclass
class Commit:
    """What one sequence committed in a step, as a drafter that learns from it sees it."""

    seq_id: int
    token_ids: Sequence[int]  # prompt + output after the step: the last is the next step's root
    position: int  # the first committed row (the step's chunk, or its tree's root)
    hidden: dict[int, torch.Tensor]  # the target's states of the committed rows, as `hidden_wanted` asks


@dataclass
class Ended:
    """A sequence that ended (finished, aborted or failed; not preempted): what the target produced."""

    seq_id: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    # The request lets later requests draft from its output (`SpeculationParams.share_output`)
    shared: bool = True


class Observes(ABC):
    """Learns from what the target commits: n-gram lookup from the tokens (it scores its own
    guesses), heads from the target's hidden states. The only place a drafter learns."""

    def hidden_wanted(self) -> tuple[int, ...]:
        """The target's hidden states it reads (layer boundaries, as `ForwardOutput.hidden` names them)."""
        return ()

    @abstractmethod
    def observe(self, commit: Commit) -> None:
        """A sequence's step is final (called for every sequence it drafts for, each step)."""

    def ended(self, ended: Ended) -> None:  # noqa: B027 - most learn only within a sequence
        """A sequence it drafted for ended, with all it produced (its last step's tokens too, which
        no commit shows: a finished sequence is not observed), just before `release`."""


class Estimates:
    """Knows, before drafting, what its proposals are worth or cost. The speculation policy asks
    while planning, and asking changes no estimate (a drafter may keep the guess it was asked
    about, to score it at later commits): answers never depend on what was asked before."""

    def acceptance_profile(self, seq_id: int, token_ids: Sequence[int], max_depth: int) -> Sequence[float] | None:
        """What its proposal for the sequence would be worth now: P(its first k drafted tokens
        are all accepted), k = 1..max_depth (zeros: it has nothing to propose). None: no
        estimate of its own; the policy goes by the sequence's measured acceptance."""
        return None

    def acceptance_bound(self) -> float | None:
        """At most what the first drafted token of any of its proposals is worth now, by its
        `acceptance_profile` (None: no estimate). A busy step where not even that would pay for
        a node is decided without asking for every sequence's profile."""
        return None

    def step_cost(self, tree_budget: int) -> float:
        """Seconds it expects to spend on a step whose largest tree has `tree_budget` drafted
        nodes (the policy weighs it against the tokens it buys)."""
        return 0.0


@dataclass
class DraftTarget:
    """What a drafter may use of the engine it serves: the target's runner (and its KV pool),
    the pool's size in blocks, the target's vocabulary (draft distributions are padded to it)
    and where its weights are."""

    runner: ModelRunner
    num_blocks: int
    block_size: int
    vocab_size: int
    model_dir: Path | None = None  # the target's weights (trained heads check they belong to it)
