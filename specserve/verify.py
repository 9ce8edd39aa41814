"""Verification: which drafted nodes the target accepts, and the token it adds after them.

Lossless recursive rejection sampling over the tree (SpecInfer; without replacement as in
Recursive Speculative Decoding): children are tried in order, one drawn from a draft q is
accepted with min(1, p(x) / q(x)), a deterministic one with p(x); on rejection p keeps the
residual, and where no child is accepted a bonus token is drawn from what is left. Greedy is p
one-hot at the argmax. `verify` walks one tree (the oracle); `verify_batch` does a step's trees
at once on the logits' device. Details: docs/design.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from specserve.sampling import (
    NON_FINITE,
    FilterStats,
    SamplingError,
    SamplingRow,
    argmax_rows,
    filter_stats,
    inverse_cdf,
    penalize,
    sample_rows,
    sampling_distribution,
)
from specserve.tree import TokenTree

Logprob = tuple[float, list[tuple[int, float]]]  # a token's log-probability, the top alternatives


@dataclass
class Verdict:
    """The accepted path (node indices, root first) and the tokens the step emits.

    `tokens[j]` was predicted by the target's logits at node `path[j]`: the accepted drafted
    tokens `tree.tokens[path[1:]]`, then the bonus token.
    """

    path: list[int]
    tokens: list[int]
    logprobs: list[Logprob] | None = None  # per emitted token, when the candidate asked (`verify_batch`)
    error: SamplingError | None = None  # non-finite logits on the path: the request fails (`verify_batch`)

    @property
    def num_accepted(self) -> int:
        """Drafted tokens accepted (the bonus token not counted)."""
        return len(self.path) - 1


def verify(
    tree: TokenTree, logits: torch.Tensor, row: SamplingRow, draft_probs: Mapping[int, torch.Tensor] | None = None
) -> Verdict:
    """Walk `tree` with the target's `logits` (`[len(tree), vocab]`, one row per node).

    `draft_probs[u]`, when present, is the distribution u's children were sampled from
    (without replacement); children of other nodes count as deterministic proposals.
    """
    if logits.shape[0] != len(tree):
        raise ValueError(f"need one row of logits per tree node: {logits.shape[0]} rows for {len(tree)} nodes")
    if row.params.plain_greedy:
        return _verify_argmax(tree, logits.argmax(-1).tolist())
    draft_probs = draft_probs or {}
    path, tokens = [0], []
    while True:
        node = path[-1]
        history = SamplingRow(row.params, row.prompt_ids, [*row.output_ids, *tokens], row.generator)
        p = sampling_distribution(logits[node], history)
        q = draft_probs.get(node)
        q = None if q is None else q.float().clone()
        accepted = None
        for child in tree.children[node]:
            x = tree.tokens[child]
            q_x = torch.ones(()) if q is None else q[x]
            if float(torch.rand((), generator=row.generator)) < float(accept_probability(p[x], q_x)):
                accepted = child
                break
            p = _residual(p, q, x)
            if q is not None:
                q[x] = 0
                total = q.sum()
                q = q / total if total > 0 else q
        if accepted is None:
            generator = row.generator  # a host generator draws from a host copy of p
            source = p if generator is None or generator.device == p.device else p.cpu()
            bonus = int(p.argmax()) if row.params.greedy else int(torch.multinomial(source, 1, generator=generator))
            return Verdict(path, [*tokens, bonus])
        path.append(accepted)
        tokens.append(tree.tokens[accepted])


def _residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """The target's distribution given that draft x was rejected: norm(max(p - q, 0))."""
    if q is None:
        rest = p.clone()
        rest[x] = 0
    else:
        rest = (p - q).clamp_(min=0)
    total = rest.sum()
    return rest / total if total > 0 else p  # p == q exactly: x would have been accepted


def _verify_argmax(tree: TokenTree, argmax: list[int]) -> Verdict:
    """Greedy without penalties: follow the child equal to the target's argmax while there is one."""
    path, tokens = [0], []
    while True:
        node = path[-1]
        want = argmax[node]
        tokens.append(want)
        child = next((c for c in tree.children[node] if tree.tokens[c] == want), None)
        if child is None:
            return Verdict(path, tokens)
        path.append(child)


# -- all of a step's trees at once -------------------------------------------------------------


@dataclass
class Candidate:
    """One request's tree in a step's batched verification: a decode or a prompt's last chunk is
    a root-only tree. `draft_probs` as in `verify`; `logprobs`: how many top alternatives to return
    with each emitted token's log-probability (None: none)."""

    tree: TokenTree
    row: SamplingRow
    draft_probs: Mapping[int, torch.Tensor] = field(default_factory=dict)
    logprobs: int | None = None


def verify_batch(candidates: Sequence[Candidate], logits: torch.Tensor) -> list[Verdict]:
    """`verify` for every candidate at once, as tensor ops on the logits' device (`logits`: the
    candidates' node rows in order, [total nodes, vocab]); the same algorithm and distribution.
    Greedy trees: every node's (penalised) argmax, then the host follows each root's first child
    equal to it. Sampled trees: all walks at once, without waiting on the host: each walk's
    uniforms are drawn up front from its request's generator (one per child, one for the bonus),
    every node's filtered distribution is summarised (a threshold and a normaliser:
    `sampling.FilterStats`), every inner node's descent decided from p at its children, and each
    walk's stop found by following them (see `_sample`). The step reads the device once (argmax,
    decisions, bonus tokens), twice when logprobs are asked."""
    sizes = [len(c.tree) for c in candidates]
    if logits.shape[0] != sum(sizes):
        raise ValueError(f"need one row of logits per tree node: {logits.shape[0]} rows for {sum(sizes)} nodes")
    if not candidates:
        return []
    if all(c.row.params.plain_greedy and c.logprobs is None for c in candidates):
        return _plain_greedy(candidates, logits)
    batch = _Batch.build(candidates, logits.device)
    scores = logits.float()
    if batch.penalized:
        at = batch.tensor(batch.penalized)
        scores = scores.index_copy(0, at, penalize(scores[at], [batch.rows[u] for u in batch.penalized]))
    n = len(batch.tokens)
    # read 1 brings these back, each n long but "top" (k per logprob node)
    parts = {"bonus": torch.zeros(n, dtype=torch.int64, device=logits.device)}
    if any(not c.row.params.plain_greedy for c in candidates):  # these fail on non-finite logits
        parts["finite"] = torch.ones(n, dtype=torch.int64, device=logits.device)
    if any(len(c.tree) > 1 and not c.row.params.greedy for c in candidates):  # sampled walks' decisions
        parts["decision"] = torch.full((n,), -1, dtype=torch.int64, device=logits.device)
    if batch.greedy:
        _greedy(batch, scores, parts)
    if batch.sampled:
        _sample(batch, candidates, scores, parts)
    floats: list[torch.Tensor] = []
    if batch.logprob_nodes:
        emitted = parts["bonus"]
        if "decision" in parts:
            decision = parts["decision"]
            emitted = torch.where(decision >= 0, batch.tensor(batch.tokens)[decision.clamp(min=0)], emitted)
        at = batch.tensor(batch.logprob_nodes)
        logprobs = torch.log_softmax(logits[at].float(), dim=-1)
        top = torch.topk(logprobs, batch.top_k, dim=-1)
        parts["top"] = top.indices.flatten()
        floats = [logprobs.gather(1, emitted[at][:, None]).flatten(), top.values.flatten()]
    values = torch.cat(list(parts.values())).tolist()  # read 1
    read = torch.cat(floats).tolist() if floats else []  # read 2, only when logprobs were asked
    decided = {name: values[i * n:(i + 1) * n] for i, name in enumerate(parts) if name != "top"}
    decided["top"] = values[(len(parts) - 1) * n:] if "top" in parts else []
    return batch.walk(decided, read, candidates)


def _plain_greedy(candidates: Sequence[Candidate], logits: torch.Tensor) -> list[Verdict]:
    """Every candidate greedy without penalties or logprobs (a greedy server's every step): each
    node's argmax read back at once, each tree followed on the host. The general path's verdicts,
    with a fraction of its calls: right after a forward the caches are cold, and there each
    torch call costs several times what it does warm (a batch-1 decode step: 220-300 us that way, 137 us this)."""
    argmax = argmax_rows(logits.float())[1].tolist()
    verdicts, base = [], 0
    for c in candidates:
        verdicts.append(_verify_argmax(c.tree, argmax[base:base + len(c.tree)]))
        base += len(c.tree)
    return verdicts


def _greedy(batch: _Batch, scores: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
    """The greedy candidates' nodes' (penalised) argmax, in `parts["bonus"]`: the host's walk
    accepts a node's first child equal to it and adds it where none is (`_Batch.walk`)."""
    at = None if len(batch.greedy) == len(batch.tokens) else batch.tensor(batch.greedy)
    best, argmax = argmax_rows(scores if at is None else scores[at])
    where = slice(None) if at is None else at
    if "finite" in parts:
        parts["finite"][where] = torch.isfinite(best).to(torch.int64)
    parts["bonus"][where] = argmax


def accept_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """Speculative sampling's acceptance rule, elementwise (a seam the tests break on purpose)."""
    return torch.where(q_x > 0, (p_x / q_x).clamp(max=1.0), torch.zeros_like(p_x))


@dataclass
class _Batch:
    """A step's trees flattened: node u of candidate b is row offsets[b] + u of the logits."""

    device: torch.device
    tokens: list[int]
    owner: list[int]  # candidate of each node
    depth: list[int]  # of each node in its tree
    offsets: list[int]
    rows: dict[int, SamplingRow]  # penalised nodes' rows: the path's tokens in their history
    penalized: list[int]
    greedy: list[int]  # nodes of greedy candidates
    sampled: list[int]  # nodes of sampled candidates
    logprob_nodes: list[int]
    children: list[tuple[int, ...]]  # flat children of each node, in the order they are tried
    draft_rows: dict[int, torch.Tensor]  # the draft distribution a node's children were sampled from
    logprobs_wanted: list[int]  # per candidate (0: none)

    @classmethod
    def build(cls, candidates: Sequence[Candidate], device: torch.device) -> _Batch:
        batch = cls(device, [], [], [], [], {}, [], [], [], [], [], {}, [c.logprobs or 0 for c in candidates])
        for b, c in enumerate(candidates):
            base = len(batch.tokens)
            batch.offsets.append(base)
            batch.tokens += c.tree.tokens
            batch.owner += [b] * len(c.tree)
            batch.depth += c.tree.depths
            if c.row.params.greedy:  # the host's walk reads its own tree
                batch.children += [()] * len(c.tree)
            else:
                batch.children += [tuple(base + k for k in kids) for kids in c.tree.children]
            batch.draft_rows.update((base + u, q) for u, q in c.draft_probs.items())
            nodes = range(base, base + len(c.tree))
            params = c.row.params
            if params.needs_penalties:
                for u in range(len(c.tree)):
                    path = c.tree.path_tokens(u)[1:]  # what the walk has emitted on reaching u
                    batch.rows[base + u] = SamplingRow(params, c.row.prompt_ids, [*c.row.output_ids, *path])
                batch.penalized += nodes
            if params.greedy:
                batch.greedy += nodes
            else:
                batch.sampled += nodes
            if c.logprobs is not None:
                batch.logprob_nodes += nodes
        return batch

    def tensor(self, values: Sequence[int]) -> torch.Tensor:
        """Host integers (node indices, tokens) as a tensor on the logits' device."""
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    @property
    def top_k(self) -> int:
        """Alternatives per logprob node: the most any candidate asked for."""
        return max(self.logprobs_wanted[self.owner[u]] for u in self.logprob_nodes)

    def walk(self, decided: dict[str, list[int]], read: list[float],
             candidates: Sequence[Candidate]) -> list[Verdict]:
        """Each candidate's path from its root by the nodes' decisions (on the host, from read 1):
        a greedy tree's first child equal to its node's argmax, a sampled one's decided child."""
        decision, bonus, finite, top_tokens = (decided.get(name) for name in ("decision", "bonus", "finite", "top"))
        where = {u: i for i, u in enumerate(self.logprob_nodes)}
        k, m = (self.top_k, len(self.logprob_nodes)) if self.logprob_nodes else (0, 0)
        verdicts = []
        for b, c in enumerate(candidates):
            base = self.offsets[b]
            if c.row.params.greedy:
                verdict = _verify_argmax(c.tree, bonus[base:base + len(c.tree)])
            else:
                path = [0]
                while decision is not None and decision[base + path[-1]] >= 0:
                    path.append(decision[base + path[-1]] - base)
                verdict = Verdict(path, [*(c.tree.tokens[u] for u in path[1:]), bonus[base + path[-1]]])
            path = verdict.path
            if finite is not None and not c.row.params.plain_greedy and not all(finite[base + u] for u in path):
                verdict.error = SamplingError(NON_FINITE)
            if c.logprobs is not None:
                verdict.logprobs = []
                for u in path:
                    i = where[base + u]
                    alternatives = zip(top_tokens[i * k:i * k + c.logprobs], read[m + i * k:m + i * k + c.logprobs],
                                       strict=True)
                    verdict.logprobs.append((read[i], list(alternatives)))
            verdicts.append(verdict)
        return verdicts


def _sample(batch: _Batch, candidates: Sequence[Candidate], scores: torch.Tensor,
            parts: dict[str, torch.Tensor]) -> None:
    """The sampled candidates' walks, all at once (in place: `decision` of their inner nodes,
    `bonus` of the node each walk stops at). With every edge's uniform drawn up front, which
    child a node would descend into (its first accepted child, the earlier ones rejected) does
    not depend on how the walk got there: it is decided for every inner node together, from
    the nodes' filtered distributions (`FilterStats`, one pass over each row), and each walk's
    stop node found by following those decisions from its root, log2(depth) gathers. The bonus
    is drawn there from what is left once all its children are rejected: as `verify` does."""
    walks = [b for b, c in enumerate(candidates) if not c.row.params.greedy]
    nodes_of_walks = [u for b in walks for u in range(batch.offsets[b], batch.offsets[b] + len(candidates[b].tree))]
    inner = [u for u in nodes_of_walks if batch.children[u]]
    stats = _NodeStats.build(batch, candidates, nodes_of_walks, scores)
    sampled = batch.tensor(nodes_of_walks)
    parts["finite"][sampled] = stats.finite[sampled].to(torch.int64)
    width = max((len(batch.children[u]) for u in inner), default=1)
    table = _ChildTable.build(batch, inner, width, scores.device)
    edge_u, bonus_u = _uniforms(batch, candidates)
    stop = batch.tensor([batch.offsets[b] for b in walks])  # the roots
    if inner:
        nodes = batch.tensor(inner)
        if table.draft is None:
            chance = _chances(table, nodes, stats.at(scores, nodes, table.tokens[nodes]))
        else:
            chance, _ = _drafted_chances(table, nodes, stats.rows(scores, nodes))
        kids = table.children[nodes]
        accepted = (edge_u[kids.clamp(min=0)] < chance) & (kids >= 0)
        first = kids.gather(1, accepted.to(torch.uint8).argmax(1, keepdim=True)).flatten()
        descend = torch.where(accepted.any(1), first, -1)
        parts["decision"][nodes] = descend
        follow = torch.arange(len(batch.tokens), device=scores.device)
        follow[nodes] = torch.where(descend >= 0, descend, nodes)
        for _ in range(max(batch.depth[u] for u in nodes_of_walks).bit_length()):  # 2^k >= the deepest walk
            follow = follow[follow]
        stop = follow[stop]
    if table.draft is None:  # what is left of p once a stopped walk's children are all rejected
        tried = torch.where(table.children[stop] >= 0, table.tokens[stop], -1)
        bonus = sample_rows(scores, stop, stats.temperature[stop], stats.of(stop), tried, bonus_u[stop])
    else:
        p = stats.rows(scores, stop)
        _, p = _drafted_chances(table, stop, p)
        bonus = inverse_cdf(p, bonus_u[stop])
    parts["bonus"][stop] = bonus


@dataclass
class _NodeStats:
    """Every sampled node's filtered distribution (`FilterStats`), indexed by flat node (other
    nodes' entries unused), and its temperature."""

    temperature: torch.Tensor  # [nodes]
    threshold: torch.Tensor
    log_norm: torch.Tensor
    finite: torch.Tensor

    @classmethod
    def build(cls, batch: _Batch, candidates: Sequence[Candidate], nodes: list[int], scores: torch.Tensor
              ) -> _NodeStats:
        params = [candidates[batch.owner[u]].row.params for u in nodes]
        at = batch.tensor(nodes)
        found = filter_stats(scores if len(nodes) == len(batch.tokens) else scores[at], params)
        n = len(batch.tokens)
        full = cls(*(torch.ones(n, dtype=t.dtype, device=scores.device) for t in
                     (scores, found.threshold, found.log_norm, found.finite)))
        full.temperature[at] = torch.tensor([p.temperature for p in params], dtype=scores.dtype, device=scores.device)
        full.threshold[at], full.log_norm[at], full.finite[at] = found.threshold, found.log_norm, found.finite
        return full

    def of(self, nodes: torch.Tensor) -> FilterStats:
        return FilterStats(self.threshold[nodes], self.log_norm[nodes], self.finite[nodes])

    def at(self, scores: torch.Tensor, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """p(x) at each node for the given tokens ([nodes, width]): a gather, not a row."""
        return self.of(nodes).probabilities(scores[nodes[:, None], tokens], self.temperature[nodes])

    def rows(self, scores: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """The nodes' whole distributions ([nodes, vocab])."""
        return self.of(nodes).probabilities(scores[nodes], self.temperature[nodes])


@dataclass
class _ChildTable:
    """Per node of the sampled trees (rows indexed by flat node): its children in the order they
    are tried (-1: none), their tokens, whether each is a token not already tried before it,
    and its draft distribution's row in `draft` (-1: deterministic children)."""

    children: torch.Tensor  # [nodes, width] int64
    tokens: torch.Tensor  # [nodes, width] int64
    fresh: torch.Tensor  # [nodes, width] bool
    draft_row: torch.Tensor  # [nodes] int64
    draft: torch.Tensor | None  # [drafted nodes, vocab]

    @classmethod
    def build(cls, batch: _Batch, nodes: list[int], width: int, device: torch.device) -> _ChildTable:
        n = len(batch.tokens)
        children, tokens = [[-1] * width for _ in range(n)], [[0] * width for _ in range(n)]
        fresh = [[False] * width for _ in range(n)]
        draft_row, drafts = [-1] * n, []
        for u in nodes:
            for j, c in enumerate(batch.children[u]):
                children[u][j], tokens[u][j] = c, batch.tokens[c]
                fresh[u][j] = batch.tokens[c] not in tokens[u][:j] or j == 0
            if u in batch.draft_rows:
                draft_row[u] = len(drafts)
                drafts.append(batch.draft_rows[u])
        draft = torch.stack(drafts).float().to(device) if drafts else None
        return cls(*(torch.tensor(t, device=device) for t in (children, tokens, fresh, draft_row)), draft)


def _chances(table: _ChildTable, nodes: torch.Tensor, p_x: torch.Tensor) -> torch.Tensor:
    """Each node's chance of accepting each child, its earlier children rejected ([nodes, width]),
    children proposed deterministically, from p at their tokens (`p_x`): rejecting x leaves p
    without x, renormalised, so child j is accepted with p(x_j) / (1 - the mass of the tokens
    rejected before it), 0 for a token already rejected."""
    fresh = table.fresh[nodes] & (table.children[nodes] >= 0)
    p_x = p_x * fresh
    left = 1 - (p_x.cumsum(1) - p_x)  # the mass left after the earlier rejections
    residual_x = torch.where(fresh & (left > 0), p_x / left.clamp(min=torch.finfo(p_x.dtype).tiny), 0.0)
    return torch.as_tensor(accept_probability(residual_x, torch.ones_like(residual_x)), dtype=p_x.dtype,
                           device=p_x.device).expand_as(residual_x)


def _drafted_chances(table: _ChildTable, nodes: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_chances` child after child (nodes with a draft q, and deterministic ones as a point mass)."""
    kids = table.children[nodes]
    rows = table.draft_row[nodes]
    has_q = rows >= 0
    q = table.draft[rows.clamp(min=0)]
    every = torch.arange(len(nodes), device=p.device)
    chances = []
    for j in range(kids.shape[1]):
        x = table.tokens[nodes, j]
        live = (kids[:, j] >= 0) & table.fresh[nodes, j]
        p_x, q_x = p[every, x], torch.where(has_q, q[every, x], torch.ones_like(p[every, x]))
        chance = torch.as_tensor(accept_probability(p_x, q_x), dtype=p.dtype, device=p.device).expand_as(p_x)
        chances.append(torch.where(live, chance, 0.0))
        without_x = p.clone()
        without_x[every, x] = 0
        residual = torch.where(has_q[:, None], (p - q).clamp(min=0), without_x)
        p = torch.where(live[:, None], _normalized(residual, p), p)
        q_rows = q.clone()
        q_rows[every, x] = 0
        q = torch.where((live & has_q)[:, None], _normalized(q_rows, q_rows), q)
    return torch.stack(chances, 1), p


def _normalized(rest: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Rows of `rest` over their sums; `fallback`'s rows where a sum is 0 (as `verify` does)."""
    total = rest.sum(-1, keepdim=True)
    return torch.where(total > 0, rest / total.clamp(min=torch.finfo(rest.dtype).tiny), fallback)


def _uniforms(batch: _Batch, candidates: Sequence[Candidate]) -> tuple[torch.Tensor, torch.Tensor]:
    """A uniform per edge (indexed by its child) and one per node for its bonus, for the sampled
    candidates: 2n - 1 draws from a request's own generator (seeded requests do not depend on
    the batch), all unseeded requests' draws in one call."""
    n = len(batch.tokens)
    edge, node = torch.zeros(n), torch.zeros(n)
    unseeded = [b for b, c in enumerate(candidates) if c.row.generator is None and not c.row.params.greedy]
    shared = iter(torch.rand(sum(2 * len(candidates[b].tree) - 1 for b in unseeded)).split(
        [2 * len(candidates[b].tree) - 1 for b in unseeded]))
    for b, c in enumerate(candidates):
        if c.row.params.greedy:
            continue
        size = len(c.tree)
        draws = next(shared) if c.row.generator is None else torch.rand(2 * size - 1, generator=c.row.generator)
        base = batch.offsets[b]
        edge[base + 1:base + size] = draws[:size - 1]
        node[base:base + size] = draws[size - 1:]
    return edge.to(batch.device), node.to(batch.device)
