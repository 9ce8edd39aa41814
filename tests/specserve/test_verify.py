"""Verification is lossless: tokens emitted through drafted trees are distributed exactly as the
target alone samples them, for sampled and deterministic drafts, under temperature, top-p and
penalties; greedy verification accepts exactly the target's argmax path.

The target here is a Markov chain over a small vocabulary (next-token logits depend on the last
token only), so the exact distribution of the first three tokens is known in closed form.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from specserve import verify as verify_module
from specserve.sampling import SamplingError, SamplingParams, SamplingRow, sampling_distribution
from specserve.tree import TokenTree
from specserve.verify import verify

VOCAB = 5
FIRST = 0  # the prompt's last token: the root of the first tree
TARGET = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 1.5
DRAFT = TARGET + torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1))  # a decent, imperfect drafter


def draft_tree(root: int, mode: str, gen: torch.Generator) -> tuple[TokenTree, dict[int, torch.Tensor]]:
    """Two levels of two children each: sampled without replacement from the drafter's
    distribution (`sampled`, with `probs`), or its top-2 (`deterministic`, no probs)."""
    tokens, parents, probs = [root], [-1], {}
    frontier = [0]
    for _ in range(2):
        next_frontier = []
        for node in frontier:
            q = DRAFT[tokens[node]].softmax(-1)
            if mode == "sampled":
                picks = torch.multinomial(q, 2, replacement=False, generator=gen).tolist()
                probs[node] = q
            else:
                picks = q.topk(2).indices.tolist()
            for token in picks:
                tokens.append(token)
                parents.append(node)
                next_frontier.append(len(tokens) - 1)
        frontier = next_frontier
    return TokenTree(tuple(tokens), tuple(parents)), probs


def speculative_prefix(params: SamplingParams, mode: str, gen: torch.Generator, length: int = 3) -> tuple[int, ...]:
    """Generate `length` tokens by repeated draft-and-verify steps."""
    output: list[int] = []
    while len(output) < length:
        tree, probs = draft_tree(output[-1] if output else FIRST, mode, gen)
        logits = TARGET[list(tree.tokens)]  # node i's next-token logits: the chain's row for its token
        verdict = verify(tree, logits, SamplingRow(params, [FIRST], list(output), gen), probs)
        assert verdict.tokens[:-1] == [tree.tokens[n] for n in verdict.path[1:]]
        output += verdict.tokens
    return tuple(output[:length])


def exact_distribution(params: SamplingParams, length: int = 3) -> torch.Tensor:
    """P(first `length` tokens) when the target samples alone, with the same sampling rules."""
    probs = torch.zeros((VOCAB,) * length, dtype=torch.float64)
    for seq in itertools.product(range(VOCAB), repeat=length):
        p, last = 1.0, FIRST
        for i, token in enumerate(seq):
            p *= float(sampling_distribution(TARGET[last], SamplingRow(params, [FIRST], list(seq[:i])))[token])
            last = token
        probs[seq] = p
    return probs


def sample_counts(params: SamplingParams, mode: str, draws: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros((VOCAB,) * 3, dtype=torch.float64)
    for _ in range(draws):
        counts[speculative_prefix(params, mode, gen)] += 1
    return counts


CASES = {
    "T=1": SamplingParams(temperature=1.0),
    "T=0.7, top_p=0.8": SamplingParams(temperature=0.7, top_p=0.8),
    "T=1, penalties": SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.5),
}


@pytest.mark.parametrize("mode", ["sampled", "deterministic"])
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_has_the_targets_distribution(case, mode, chi_square):
    params = CASES[case]
    draws = 20_000 if case == "T=1" else 6_000
    counts = sample_counts(params, mode, draws, seed=zlib.crc32(f"{case}/{mode}".encode()))  # fixed: no flakes
    p_value = chi_square(counts, exact_distribution(params))
    assert p_value > 0.01, f"{case}, {mode} drafts: chi-square rejects equality (p = {p_value:.2e})"


@pytest.mark.parametrize("mode", ["sampled", "deterministic"])
def test_an_always_accepting_verifier_is_caught(mode, chi_square, monkeypatch):
    """The same test must fail for a broken verifier, or it proves nothing."""
    monkeypatch.setattr(verify_module, "accept_probability", lambda p_x, q_x: 1.0)
    params = CASES["T=1"]
    counts = sample_counts(params, mode, 20_000, seed=5)
    assert chi_square(counts, exact_distribution(params)) < 0.01


def test_greedy_accepts_exactly_the_argmax_path():
    tree = TokenTree((0, 3, 1, 2, 4, 2), (-1, 0, 0, 1, 1, 2))
    logits = torch.full((len(tree), 8), -5.0)
    for node, best in enumerate([3, 4, 2, 6, 7, 1]):  # node 0 wants 3 (node 1), node 1 wants 4 (node 4)
        logits[node, best] = 5.0
    verdict = verify(tree, logits, SamplingRow(SamplingParams(temperature=0), [0], []))
    assert verdict.path == [0, 1, 4] and verdict.tokens == [3, 4, 7]
    assert verdict.num_accepted == 2


def test_greedy_with_penalties_walks_the_penalised_argmax():
    """Penalties see the path's own tokens: after drafting 3, a repeated 3 loses to 2."""
    tree = TokenTree.chain([0, 3, 3])
    logits = torch.tensor([[0.0, 0, 1.0, 2.0]] * 3)
    params = SamplingParams(temperature=0, repetition_penalty=4.0)
    verdict = verify(tree, logits, SamplingRow(params, [0], []))
    # node 0: 3 (2.0) beats 2 (1.0); node 1 has 3 in its history: 2.0 / 4 = 0.5 < 1.0 -> 2
    assert verdict.path == [0, 1] and verdict.tokens == [3, 2]


def test_rows_must_match_nodes():
    with pytest.raises(ValueError, match="one row of logits per tree node"):
        verify(TokenTree.chain([1, 2]), torch.zeros(3, 4), SamplingRow(SamplingParams(), [1], []))


# -- batched verification: the oracle above, all trees at once ----------------------------------


def random_tree(gen: torch.Generator, vocab: int, size: int) -> TokenTree:
    """A random tree: each node's parent any earlier node, tokens from a small vocabulary (so
    drafted tokens often equal the target's choice, and siblings sometimes repeat)."""
    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, size)]
    tokens = torch.randint(0, vocab, (size,), generator=gen).tolist()
    return TokenTree(tuple(tokens), tuple(parents))


def oracle_logprobs(logits: torch.Tensor, verdict, k: int):
    from specserve.sampling import top_logprobs

    return [top_logprobs(logits[node], token, k) for node, token in zip(verdict.path, verdict.tokens, strict=True)]


@pytest.mark.parametrize("penalties", [False, True])
def test_batched_greedy_verification_equals_the_oracle_tree_by_tree(penalties):
    from specserve.verify import Candidate, verify_batch

    gen = torch.Generator().manual_seed(3 + penalties)
    vocab = 6
    for _ in range(30):
        candidates, rows_of_logits = [], []
        for b in range(int(torch.randint(1, 9, (), generator=gen))):
            tree = random_tree(gen, vocab, int(torch.randint(1, 12, (), generator=gen)))
            logits = torch.randn(len(tree), vocab, generator=gen) * 3
            params = (SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.7, logprobs=2)
                      if penalties and b % 2 else SamplingParams(temperature=0, logprobs=2 if b % 3 == 0 else None))
            history = torch.randint(0, vocab, (4,), generator=gen).tolist()
            row = SamplingRow(params, history[:2], history[2:])
            candidates.append(Candidate(tree, row, logprobs=params.logprobs))
            rows_of_logits.append(logits)
        verdicts = verify_batch(candidates, torch.cat(rows_of_logits))
        for c, logits, got in zip(candidates, rows_of_logits, verdicts, strict=True):
            want = verify(c.tree, logits, c.row)
            assert (got.path, got.tokens) == (want.path, want.tokens)
            assert got.error is None
            if c.logprobs is None:
                assert got.logprobs is None
            else:
                for (lp, top), (want_lp, want_top) in zip(got.logprobs, oracle_logprobs(logits, want, c.logprobs),
                                                          strict=True):
                    assert lp == pytest.approx(want_lp, abs=1e-5) and [t for t, _ in top] == [t for t, _ in want_top]


def test_batched_plain_greedy_verification_equals_the_oracle_tree_by_tree():
    """Greedy trees without penalties or logprobs (a greedy server's every step) take the shortest
    way through `verify_batch`: the same verdicts as `verify`, tree by tree."""
    from specserve.verify import Candidate, verify_batch

    gen = torch.Generator().manual_seed(11)
    vocab = 6
    row = SamplingRow(SamplingParams(temperature=0), [0], [1])
    for _ in range(30):
        trees = [random_tree(gen, vocab, int(torch.randint(1, 12, (), generator=gen)))
                 for _ in range(int(torch.randint(1, 9, (), generator=gen)))]
        logits = [torch.randn(len(tree), vocab, generator=gen) * 3 for tree in trees]
        verdicts = verify_batch([Candidate(tree, row) for tree in trees], torch.cat(logits))
        for tree, rows, got in zip(trees, logits, verdicts, strict=True):
            want = verify(tree, rows, row)
            assert (got.path, got.tokens, got.error, got.logprobs) == (want.path, want.tokens, None, None)


def batched_prefixes(params: SamplingParams, draws: int, seed: int, batch: int = 64) -> torch.Tensor:
    """`draws` runs of `speculative_prefix`, `batch` at a time in lockstep through `verify_batch`,
    half of them with sampled drafts and half with deterministic ones (both exact)."""
    from specserve.verify import Candidate, verify_batch

    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros((VOCAB,) * 3, dtype=torch.float64)
    for start in range(0, draws, batch):
        outputs: list[list[int]] = [[] for _ in range(min(batch, draws - start))]
        while live := [i for i, out in enumerate(outputs) if len(out) < 3]:
            candidates, logits = [], []
            for i in live:
                tree, probs = draft_tree(outputs[i][-1] if outputs[i] else FIRST,
                                         "sampled" if i % 2 else "deterministic", gen)
                candidates.append(Candidate(tree, SamplingRow(params, [FIRST], list(outputs[i])), probs))
                logits.append(TARGET[list(tree.tokens)])
            for i, verdict in zip(live, verify_batch(candidates, torch.cat(logits)), strict=True):
                outputs[i] += verdict.tokens
        for out in outputs:
            counts[tuple(out[:3])] += 1
    return counts


@pytest.mark.parametrize("case", list(CASES))
def test_batched_sampling_has_the_targets_distribution(case, chi_square):
    params = CASES[case]
    draws = 20_000 if case == "T=1" else 6_000
    counts = batched_prefixes(params, draws, seed=zlib.crc32(f"batched/{case}".encode()))
    p_value = chi_square(counts, exact_distribution(params))
    assert p_value > 0.01, f"{case}: chi-square rejects equality (p = {p_value:.2e})"


def test_an_always_accepting_batched_verifier_is_caught(chi_square, monkeypatch):
    monkeypatch.setattr(verify_module, "accept_probability", lambda p_x, q_x: 1.0)
    params = CASES["T=1"]
    assert chi_square(batched_prefixes(params, 20_000, seed=5), exact_distribution(params)) < 0.01


def test_a_seeded_request_draws_the_same_whatever_else_is_in_the_batch():
    from specserve.verify import Candidate, verify_batch

    def verdicts_of_seeded(others: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(0)
        seeded = torch.Generator().manual_seed(42)
        out = []
        for _ in range(10):
            tree, probs = draft_tree(FIRST, "sampled", torch.Generator().manual_seed(1))
            mine = Candidate(tree, SamplingRow(SamplingParams(temperature=1.0, seed=42), [FIRST], [], seeded), probs)
            rest = [Candidate(draft_tree(FIRST, "deterministic", gen)[0], SamplingRow(SamplingParams(), [FIRST], []))
                    for _ in range(others)]
            batch = [*rest[: others // 2], mine, *rest[others // 2:]]
            logits = torch.cat([TARGET[list(c.tree.tokens)] for c in batch])
            out.append(verify_batch(batch, logits)[others // 2].tokens)
        return out

    assert verdicts_of_seeded(0) == verdicts_of_seeded(5) == verdicts_of_seeded(2)


def test_non_finite_logits_on_the_path_fail_the_request_and_off_it_do_not():
    from specserve.verify import Candidate, verify_batch

    tree = TokenTree((0, 1, 2), (-1, 0, 0))  # the root wants 1: node 1 is on the path, node 2 is not
    logits = torch.tensor([[0.0, 9.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=1.1)  # greedy that forms distributions
    off_path, on_path = logits.clone(), logits.clone()
    off_path[2, 0] = float("nan")
    on_path[1, 2] = float("inf")
    row = SamplingRow(params, [0], [])
    good, bad = verify_batch([Candidate(tree, row), Candidate(tree, row)], torch.cat([off_path, on_path]))
    assert good.error is None and good.path == [0, 1]
    assert isinstance(bad.error, SamplingError)
