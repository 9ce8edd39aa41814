"""Verification: which drafted nodes the target accepts, and the token it adds after them.

One algorithm serves greedy and sampling: lossless recursive rejection sampling over the
tree (SpecInfer's multi-step speculative sampling; without replacement as in Recursive
Speculative Decoding). Walk down from the root. At node u, with `p` the target's
sampling distribution there (the request's penalties, temperature, top-k/p, min-p, with
the path's tokens as history), try u's children in order:

* a child drawn from a draft distribution `q` (the drafter sampled u's children from `q`
  without replacement) is accepted with probability min(1, p(x) / q(x)); on rejection
  p <- norm(max(p - q, 0)) and q loses x (renormalised) before the next child;
* a child proposed deterministically (top-k, n-gram lookup, a merged tree) is the same
  rule with q = a point mass on x: accepted with probability p(x); on rejection p loses x.

The first accepted child is descended into. Where no child is accepted, or at a leaf, one
more token is drawn from what is left of p: the bonus token. Every emitted token is thus
distributed exactly as the target alone would sample it. Greedy is the case where p is
one-hot at the argmax: the walk accepts exactly the children equal to the target's argmax.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from specserve.sampling import SamplingRow, sampling_distribution
from specserve.tree import TokenTree


@dataclass
class Verdict:
    """The accepted path (node indices, root first) and the tokens the step emits.

    `tokens[j]` was predicted by the target's logits at node `path[j]`: the accepted drafted
    tokens `tree.tokens[path[1:]]`, then the bonus token.
    """

    path: list[int]
    tokens: list[int]

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
            q_x = 1.0 if q is None else float(q[x])
            if float(torch.rand((), generator=row.generator)) < accept_probability(float(p[x]), q_x):
                accepted = child
                break
            p = _residual(p, q, x)
            if q is not None:
                q[x] = 0
                total = q.sum()
                q = q / total if total > 0 else q
        if accepted is None:
            bonus = int(p.argmax()) if row.params.greedy else int(torch.multinomial(p, 1, generator=row.generator))
            return Verdict(path, [*tokens, bonus])
        path.append(accepted)
        tokens.append(tree.tokens[accepted])


def accept_probability(p_x: float, q_x: float) -> float:
    """Speculative sampling's acceptance rule (a seam the tests break on purpose)."""
    return min(1.0, p_x / q_x) if q_x > 0 else 0.0


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
