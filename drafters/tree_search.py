"""Drafting with a language model: grow each request's tree best-first by draft probability.

One draft forward per round serves every request of the step (EAGLE-2's dynamic tree for
greedy requests; for sampled ones, children drawn from q without replacement, as lossless
verification needs). Subclasses say how to forward. Why it is built so: docs/design.md.
"""

from __future__ import annotations

import heapq
import math
import time
from abc import abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from drafters.base import Draft, Drafter, DraftRequest, Estimates, UsesTarget
from specserve.cost_model import RecentMedian
from specserve.model_runner import LogitsWanted, TreeRequest
from specserve.tree import TokenTree

# A round expands a candidate only if its path is at least a tenth as likely as the round's
# best: a confident draft then grows a chain instead of spending its slots on long shots
# (which still make the tree as leaves if they rank among the best candidates).
_LOG_MIN_RATIO = math.log(0.1)


class TreeSearchDrafter(Drafter, UsesTarget, Estimates):
    """A drafter that runs a language model round by round; subclasses say how to forward."""

    def __init__(self, top_k: int = 4, beam: int = 4, max_rounds: int | None = None):
        if top_k < 1 or beam < 1:
            raise ValueError(f"tree search needs top_k >= 1 and beam >= 1, got top_k={top_k}, beam={beam}")
        self.top_k, self.beam, self.max_rounds = top_k, beam, max_rounds
        self.vocab_size: int | None = None  # the target's, set by attach()
        # The token of each column of `_forward`'s logits (None: column i is token i, and columns
        # from the target's vocabulary size on are padding); a head scores its draft vocabulary only.
        self.column_tokens: torch.Tensor | None = None
        self.forwards = 0  # draft forwards run so far
        self._round_times = RecentMedian()  # growth rounds' forwards (the first round also catches up)
        self.rounds_per_step: float | None = None  # running average of the rounds a step takes

    @property
    def round_seconds(self) -> float | None:
        """A growth round's typical time (None until measured a few times)."""
        return self._round_times.value

    def step_cost(self, tree_budget: int) -> float:
        """A round's measured time times the rounds a step takes (a chain of `tree_budget` at
        most); 0 until measured: the policy then tries speculation and learns what it costs."""
        if self.round_seconds is None or tree_budget <= 0:
            return 0.0
        return self.round_seconds * min(tree_budget, self.rounds_per_step or 1.0)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        if self.vocab_size is None:
            raise RuntimeError(f"drafter {self.spec!r} was never attached to an engine")
        # Each request pays its share of a round that serves them all.
        share = None if self.round_seconds is None else self.round_seconds / max(1, len(requests))
        searches = [_Search(r, self.top_k, self.beam, self.max_rounds, share) for r in requests]
        active = [s for s in searches if s.frontier]
        rounds = 0
        while active:
            self.forwards += 1
            start = time.perf_counter()
            for search, logits in zip(active, self._forward(active), strict=True):
                if self.column_tokens is None:
                    logits = logits[:, : self.vocab_size]
                search.expand(logits, self.vocab_size, self.column_tokens)
            if rounds:  # the first round also catches up on new tokens (a whole prompt, at times)
                self._round_times.add(time.perf_counter() - start)
            rounds += 1
            active = [s for s in active if s.next_round()]
        if rounds:
            self.rounds_per_step = rounds if self.rounds_per_step is None else 0.8 * self.rounds_per_step + 0.2 * rounds
        return [s.draft() for s in searches]

    def _tree_request(self, search: _Search) -> TreeRequest:
        """The tree so far, root at the sequence's last slot; logits for the frontier nodes."""
        request = search.request
        tree, frontier = search.forward_tree()
        return TreeRequest(tree, len(request.token_ids) - 1, request.block_table, tuple(frontier))

    @abstractmethod
    def _forward(self, searches: list[_Search]) -> list[torch.Tensor]:
        """Logits `[len(frontier), columns]` for every search (see `column_tokens`), in one batched
        draft forward."""


class _Search:
    """One request's tree as it grows.

    Deterministic mode keeps every generated child as a *candidate*; only the nodes chosen for
    expansion are forwarded (`expanded`, the draft's internal tree), and the draft is the best
    `tree_budget` candidates at the end. Sampled mode keeps every drawn child: the internal tree
    and the draft are the same tree.
    """

    def __init__(self, request: DraftRequest, top_k: int, beam: int, max_rounds: int | None,
                 round_share: float | None = None):
        # The request's shape: a chain expands its one likeliest child; a "tree" every newest
        # child, level by level, and keeps the shallowest nodes; dynamic (EAGLE-2) below.
        self.shape = request.shape or "dynamic"
        top_k = request.top_k or top_k
        if self.shape == "chain":
            top_k = beam = 1
        elif self.shape == "tree":
            beam = max(request.tree_budget, 1)
        self.request, self.top_k, self.beam, self.max_rounds = request, top_k, beam, max_rounds
        self.round_share = round_share  # this request's share of a round's time (None: unmeasured)
        self.tokens, self.parents, self.depths, self.scores = [int(request.token_ids[-1])], [-1], [0], [0.0]
        self.sampled = request.temperature > 0
        self.probs: dict[int, torch.Tensor] = {}
        self.rounds = 0
        self.expanded = [0]  # deterministic: candidates forwarded so far, parents first
        self._value = 0.0  # deterministic: expected accepted tokens of the best tree so far
        self._last_gain = math.inf  # what the last round added to that
        self._newest: list[int] = []  # deterministic: the children of the last round
        self._unexpanded: list[tuple[float, int]] = []  # sampled: (-score, node)
        self.frontier = [0] if request.tree_budget > 0 and request.max_depth > 0 else []
        # What a drafter keeps per node between rounds (a feature head: the feature each node's
        # row predicted, and what the root's row read) and which nodes the last forward ran.
        self.node_state: dict[int, torch.Tensor] = {}
        self.node_input: dict[int, torch.Tensor] = {}
        self.forwarded: list[int] = []

    @property
    def remaining(self) -> int:
        return self.request.tree_budget - (len(self.tokens) - 1)

    def forward_tree(self) -> tuple[TokenTree, list[int]]:
        """The tree the draft forwards this round and the positions of the frontier in it."""
        if self.sampled:
            return TokenTree(tuple(self.tokens), tuple(self.parents)), list(self.frontier)
        position = {node: i for i, node in enumerate(self.expanded)}
        tree = TokenTree(tuple(self.tokens[n] for n in self.expanded),
                         tuple(-1 if n == 0 else position[self.parents[n]] for n in self.expanded))
        return tree, [position[n] for n in self.frontier]

    def catch_up(self, first: int, logits: LogitsWanted = "all", limit: int | None = None) -> TreeRequest:
        """A step's first round for a drafter with a cache of its own: the chain of the
        sequence's tokens from `first` (the first without its K/V) to the root (token ids above
        `limit` clamped to it)."""
        tokens = self.request.token_ids[first:]
        if limit is not None:
            tokens = [min(int(t), limit) for t in tokens]
        return TreeRequest(TokenTree.chain(tokens), first, self.request.block_table, logits)

    def forward_nodes(self) -> list[int]:
        """The nodes of `forward_tree()`, in its order."""
        return list(range(len(self.tokens))) if self.sampled else list(self.expanded)

    def draft(self) -> Draft:
        if self.sampled:
            return Draft(TokenTree(tuple(self.tokens), tuple(self.parents)), self.probs)
        return Draft(self._best_tree())

    def _best_tree(self) -> TokenTree:
        """The `tree_budget` most likely candidates. A child is never likelier than its parent
        (ties go to the shallower), so taking them in order keeps every parent in the tree."""
        if self.shape == "tree":  # level by level, each level's likeliest first
            order = sorted(range(1, len(self.tokens)), key=lambda n: (self.depths[n], -self.scores[n], n))
        else:
            order = sorted(range(1, len(self.tokens)), key=lambda n: (-self.scores[n], self.depths[n], n))
        position, tokens, parents = {0: 0}, [self.tokens[0]], [-1]
        for node in order:
            if len(tokens) > self.request.tree_budget:
                break
            if self.parents[node] in position and self.depths[node] <= self.request.max_depth:
                position[node] = len(tokens)
                tokens.append(self.tokens[node])
                parents.append(position[self.parents[node]])
        return TokenTree(tuple(tokens), tuple(parents))

    def expand(self, logits: torch.Tensor, vocab_size: int, column_tokens: torch.Tensor | None = None) -> None:
        """Children for every frontier node from its row of draft logits (column j: token
        `column_tokens[j]`, or token j)."""
        self.rounds += 1
        temperature = self.request.temperature if self.sampled else 1.0
        logq = torch.log_softmax(logits.float() / temperature, dim=-1)
        self._newest = []
        for node, row in zip(self.frontier, logq, strict=True):
            if self.sampled:
                self._sample_children(node, row, vocab_size, column_tokens)
            else:
                values, columns = row.topk(min(self.top_k, row.numel()))
                tokens = columns if column_tokens is None else column_tokens[columns]
                for value, token in zip(values.tolist(), tokens.tolist(), strict=True):
                    self._newest.append(self._add(node, token, self.scores[node] + value))
        self.frontier = []
        if not self.sampled:
            value = self._expected_accepted()
            self._value, self._last_gain = value, value - self._value

    def _expected_accepted(self) -> float:
        """Sum of the best `tree_budget` path probabilities: the expected accepted length of the
        best tree if the draft's probabilities were the target's (EAGLE-2's estimate)."""
        best = heapq.nlargest(self.request.tree_budget, self.scores[1:])
        return sum(math.exp(score) for score in best)

    def _sample_children(self, node: int, logq: torch.Tensor, vocab_size: int,
                         column_tokens: torch.Tensor | None) -> None:
        k = min(self.top_k, self.remaining)
        if k <= 0:
            return
        q = logq.exp()
        generator = self.request.generator  # a seeded request's draws come from its host generator
        source = q if generator is None or generator.device == q.device else q.cpu()
        drawn = torch.multinomial(source, k, replacement=False, generator=generator).tolist()
        if column_tokens is None:
            self.probs[node] = F.pad(q, (0, vocab_size - q.numel()))
        else:  # q over the whole vocabulary, for verification
            self.probs[node] = q.new_zeros(vocab_size).index_copy_(0, column_tokens, q)
        for column in drawn:
            token = column if column_tokens is None else int(column_tokens[column])
            self._add(node, token, self.scores[node] + float(logq[column]))

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
        """Pick the next frontier; False when the tree is done."""
        if self.max_rounds is not None and self.rounds >= self.max_rounds:
            return False
        if self.sampled:
            if self.remaining <= 0:
                return False
            while self._unexpanded and len(self.frontier) < self.beam:
                self.frontier.append(heapq.heappop(self._unexpanded)[1])
            return bool(self.frontier)
        # EAGLE-2: expand the likeliest of the newest children (the draft's K/V of a forwarded
        # node take one of the reserved slots, and the last drafted node never needs them).
        room = min(self.beam, self.request.tree_budget - len(self.expanded))
        newest = sorted(self._newest, key=lambda n: -self.scores[n])
        if room <= 0 or not newest:
            return False
        best = self.scores[newest[0]]
        floor = best + _LOG_MIN_RATIO if self.shape == "dynamic" else -math.inf  # chains and trees: as asked
        self.frontier = [n for n in newest[:room]
                         if self.scores[n] >= floor and self.depths[n] < self.request.max_depth]
        if self.frontier and self.shape == "dynamic" and not self._worth_a_round():
            self.frontier = []
        self.expanded.extend(self.frontier)
        return bool(self.frontier)

    def _worth_a_round(self) -> bool:
        """Another round pays if the tokens it should add are worth its time at the step's going
        rate (`DraftRequest.token_seconds`). Gains shrink round by round (each level's paths
        are less likely than the last's), so the last round's gain bounds the next one's."""
        if self.request.token_seconds is None or self.round_share is None:
            return True
        return self._last_gain * self.request.token_seconds >= self.round_share
