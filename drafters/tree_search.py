"""Drafting with a language model: grow each request's tree best-first by draft probability.

One draft forward per round serves every request of the step. A round runs each request's
*frontier* (the nodes chosen for expansion) and their children become candidates. Nodes are
ranked by cumulative draft log-probability, the chance that the whole path from the root is
right if the draft were the target. So a confident draft grows a deep chain and an unsure
one a bushy tree, within the step's node budget: EAGLE-2's dynamic tree.

Losslessness asks different things of the two modes:

* deterministic (greedy requests): a node's top-k children go into one candidate pool; each
  round takes the best `beam` candidates of the whole pool as new nodes, and when the rounds
  run out the best remaining candidates fill the budget as leaves. (A round skips candidates
  a tenth as likely as its best, so that a confident draft grows a chain.) Verification treats
  every child as a point-mass proposal, which is lossless whatever chose it.
* sampled (T > 0): a node's children are drawn from the draft distribution q without
  replacement and kept in draw order, as many as the budget allows. Verification relies on
  them being exactly such a draw, so which children are kept must not depend on their
  values; only the choice of which nodes to expand is best-first. q goes into the draft.

The tree so far is forwarded whole every round with the verification layout (root at slot
`len(tokens) - 1`, node i at `+ i`), so every draft forward is a plain tree-attention step;
on a CPU the repeated rows cost little next to a forward's fixed cost.
"""

from __future__ import annotations

import heapq
import math
import time
from abc import abstractmethod
from collections.abc import Sequence
from itertools import count

import torch
import torch.nn.functional as F

from drafters.base import Draft, Drafter, DraftRequest
from specserve.model_runner import TreeRequest
from specserve.tree import TokenTree

# A round expands a candidate only if its path is at least a tenth as likely as the round's
# best: a confident draft then grows a chain instead of spending the budget on long shots
# (the leftover budget still takes the best remaining candidates as leaves at the end).
_LOG_MIN_RATIO = math.log(0.1)


class TreeSearchDrafter(Drafter):
    """A drafter that runs a language model round by round; subclasses say how to forward."""

    def __init__(self, top_k: int = 4, beam: int = 4, max_rounds: int | None = None):
        if top_k < 1 or beam < 1:
            raise ValueError(f"tree search needs top_k >= 1 and beam >= 1, got top_k={top_k}, beam={beam}")
        self.top_k, self.beam, self.max_rounds = top_k, beam, max_rounds
        self.vocab_size: int | None = None  # the target's, set by attach()
        self.forwards = 0  # draft forwards run so far
        self.round_seconds: float | None = None  # running average of a growth round's forward

    def step_cost(self, max_nodes: int) -> float:
        """Rounds needed for the largest tree times a round's measured time (0 until measured:
        the policy then tries speculation and learns what it costs)."""
        if self.round_seconds is None or max_nodes <= 0:
            return 0.0
        first = min(self.top_k, max_nodes)  # the root's round adds up to top_k nodes
        return self.round_seconds * (1 + math.ceil((max_nodes - first) / max(1, min(self.beam, self.top_k))))

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        if self.vocab_size is None:
            raise RuntimeError(f"drafter {self.spec!r} was never attached to an engine")
        searches = [_Search(r, self.top_k, self.beam, self.max_rounds) for r in requests]
        active = [s for s in searches if s.frontier]
        first = True
        while active:
            self.forwards += 1
            start = time.perf_counter()
            for search, logits in zip(active, self._forward(active), strict=True):
                search.expand(logits[:, : self.vocab_size], self.vocab_size)
            if not first:  # the first round also catches up on new tokens (a whole prompt, at times)
                elapsed = time.perf_counter() - start
                self.round_seconds = elapsed if self.round_seconds is None else 0.8 * self.round_seconds + 0.2 * elapsed
            first = False
            active = [s for s in active if s.next_round()]
        return [s.draft() for s in searches]

    def _tree_request(self, search: _Search) -> TreeRequest:
        """The tree so far, root at the sequence's last slot; logits for the frontier nodes."""
        request = search.request
        return TreeRequest(search.tree(), len(request.token_ids) - 1, request.block_table, tuple(search.frontier))

    @abstractmethod
    def _forward(self, searches: list[_Search]) -> list[torch.Tensor]:
        """Logits `[len(frontier), vocab]` for every search, in one batched draft forward."""


class _Search:
    """One request's tree as it grows."""

    def __init__(self, request: DraftRequest, top_k: int, beam: int, max_rounds: int | None):
        self.request, self.top_k, self.beam, self.max_rounds = request, top_k, beam, max_rounds
        self.tokens, self.parents, self.depths, self.scores = [int(request.token_ids[-1])], [-1], [0], [0.0]
        self.sampled = request.temperature > 0
        self.probs: dict[int, torch.Tensor] = {}
        self.rounds = 0
        self._order = count()  # ties in the heaps go to the earlier candidate
        self._pool: list[tuple[float, int, int, int]] = []  # deterministic: (-score, order, parent, token)
        self._unexpanded: list[tuple[float, int]] = []  # sampled: (-score, node)
        self.frontier = [0] if request.max_nodes > 0 and request.max_depth > 0 else []

    @property
    def remaining(self) -> int:
        return self.request.max_nodes - (len(self.tokens) - 1)

    def tree(self) -> TokenTree:
        return TokenTree(tuple(self.tokens), tuple(self.parents))

    def draft(self) -> Draft:
        return Draft(self.tree(), self.probs)

    def expand(self, logits: torch.Tensor, vocab_size: int) -> None:
        """Children for every frontier node from its row of draft logits."""
        self.rounds += 1
        temperature = self.request.temperature if self.sampled else 1.0
        logq = torch.log_softmax(logits.float() / temperature, dim=-1)
        for node, row in zip(self.frontier, logq, strict=True):
            if self.sampled:
                self._sample_children(node, row, vocab_size)
            else:
                values, tokens = row.topk(min(self.top_k, row.numel()))
                for value, token in zip(values.tolist(), tokens.tolist(), strict=True):
                    heapq.heappush(self._pool, (-(self.scores[node] + value), next(self._order), node, token))
        self.frontier = []

    def _sample_children(self, node: int, logq: torch.Tensor, vocab_size: int) -> None:
        k = min(self.top_k, self.remaining)
        if k <= 0:
            return
        q = logq.exp()
        drawn = torch.multinomial(q, k, replacement=False, generator=self.request.generator).tolist()
        self.probs[node] = F.pad(q, (0, vocab_size - q.numel()))
        for token in drawn:
            self._add(node, token, self.scores[node] + float(logq[token]))

    def _add(self, parent: int, token: int, score: float) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(score)
        if self.sampled and self.depths[node] < self.request.max_depth:
            heapq.heappush(self._unexpanded, (-score, node))
        return node

    def next_round(self) -> bool:
        """Pick the next frontier (adding pool candidates as nodes); False when the tree is done."""
        last = self.max_rounds is not None and self.rounds >= self.max_rounds
        if self.sampled:
            if last or self.remaining <= 0:
                return False
            while self._unexpanded and len(self.frontier) < self.beam:
                self.frontier.append(heapq.heappop(self._unexpanded)[1])
            return bool(self.frontier)
        while self._pool and self.remaining > 0 and not self.frontier:
            take = self.remaining if last else min(self.beam, self.remaining)
            best = -self._pool[0][0]
            for _ in range(min(take, len(self._pool))):
                if not last and -self._pool[0][0] < best + _LOG_MIN_RATIO:
                    break  # far less likely than this round's best: wait, better candidates may come
                neg_score, _, parent, token = heapq.heappop(self._pool)
                node = self._add(parent, token, -neg_score)
                if self.depths[node] < self.request.max_depth:
                    self.frontier.append(node)
            if last or self.remaining <= 0:
                self.frontier = []  # leaves: nothing left to expand them into
                return False
        return bool(self.frontier)
