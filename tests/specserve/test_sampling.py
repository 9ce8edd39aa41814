"""Sampling: every transformation checked against a direct computation on the logits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.sampling import (
    GREEDY_BELOW_TEMPERATURE,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SamplingError,
    SamplingParams,
    SamplingRow,
    apply_penalties,
    filter_logits,
    sampling_distribution,
    top_logprobs,
)


def random_logits(seed: int, vocab: int = 50) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def support(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("k", [1, 5, 49])
def test_top_k_keeps_the_k_most_likely(seed, k):
    logits = random_logits(seed)
    out = filter_logits(logits, SamplingParams(top_k=k))
    assert support(out) == set(torch.argsort(logits, descending=True)[:k].tolist())


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_keeps_the_smallest_set_reaching_p(seed, p):
    logits = random_logits(seed)
    probs = logits.softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    expected, mass = set(), 0.0
    for i in order:
        expected.add(i)
        mass += probs[i]
        if mass >= p:
            break
    assert support(filter_logits(logits, SamplingParams(top_p=p))) == expected


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("min_p", [0.01, 0.2, 0.9])
def test_min_p_keeps_tokens_near_the_top(seed, min_p):
    logits = random_logits(seed)
    probs = logits.softmax(-1)
    expected = {i for i, q in enumerate(probs.tolist()) if q >= min_p * probs.max().item()}
    assert support(filter_logits(logits, SamplingParams(min_p=min_p))) == expected


def test_temperature_scales_the_logits():
    logits = random_logits(0)
    dist = sampling_distribution(logits, SamplingRow(SamplingParams(temperature=0.5), [], []))
    torch.testing.assert_close(dist, (logits / 0.5).softmax(-1))


def test_penalties_match_their_definitions():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    row = SamplingRow(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
                      prompt_ids=[0, 1], output_ids=[3, 3, 1])
    expected = logits.clone()
    for t in {0, 1, 3}:  # repetition: prompt and output tokens
        expected[t] = expected[t] / 2.0 if expected[t] > 0 else expected[t] * 2.0
    for t, count in {3: 2, 1: 1}.items():  # presence and frequency: output tokens only
        expected[t] -= 0.25 * count + 0.5
    torch.testing.assert_close(apply_penalties(logits, row), expected)


def sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    """One row sampled as the engine samples a decode: a root-only tree through verification."""
    from specserve.tree import TokenTree
    from specserve.verify import Candidate, verify_batch

    return verify_batch([Candidate(TokenTree.single(0), row)], logits[None])[0].tokens[0]


def test_greedy_takes_the_penalised_argmax():
    logits = torch.tensor([1.0, 5.0, 4.9])
    plain = SamplingRow(SamplingParams(temperature=0), [], [1])
    penalised = SamplingRow(SamplingParams(temperature=0, frequency_penalty=1.0), [], [1])
    assert [sample_row(logits, row) for row in (plain, penalised)] == [1, 2]


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.stack([random_logits(s) for s in range(3)])

    def draws(order: list[int], seeds: list[int], watch: int) -> list[int]:
        """20 steps of a batch; the tokens of the row for request `watch`."""
        rows = [SamplingRow(SamplingParams(temperature=1.0, seed=s), [], [], torch.Generator().manual_seed(s))
                for s in seeds]
        return [[sample_row(row_logits, row) for row_logits, row in zip(logits[order], rows, strict=True)]
                [order.index(watch)] for _ in range(20)]

    alone = draws([0], [7], watch=0)
    in_batch = draws([0, 1, 2], [7, 8, 9], watch=0)
    reordered = draws([2, 0], [11, 7], watch=0)
    assert alone == in_batch == reordered
    assert alone != draws([0], [8], watch=0)  # and the seed matters


def test_draws_follow_the_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    params = SamplingParams(temperature=0.8, top_k=3)
    gen = torch.Generator().manual_seed(0)
    rows = [SamplingRow(params, [], [], gen)]
    counts = torch.zeros(4)
    for _ in range(20000):
        counts[sample_row(logits, rows[0])] += 1
    expected = filter_logits(logits, params).softmax(-1) * 20000
    assert counts[3] == 0
    chi2 = sum((counts[i] - expected[i]) ** 2 / expected[i] for i in range(3)).item()
    assert chi2 < 13.8  # chi-square, 2 degrees of freedom, p = 0.001


def test_logprobs_are_the_models_own():
    logits = random_logits(3, vocab=10)
    chosen, top = top_logprobs(logits, 4, 3)
    reference = torch.log_softmax(logits, -1)
    assert math.isclose(chosen, reference[4].item(), rel_tol=1e-6)
    assert [t for t, _ in top] == torch.argsort(reference, descending=True)[:3].tolist()


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"n": 0}, "n must"), ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"logprobs": 21}, "logprobs"),
])
def test_bad_parameters_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_strings_are_normalised():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", ""]).stop == ["a"]
    assert SamplingParams(top_k=-1).top_k == 0


# -- every value the API admits gives a finite distribution ------------------------------------------

# Floats as JSON may carry them: subnormals and values that round to 0 in float32 included.
tiny = st.sampled_from([5e-324, 1e-320, 1e-46, 1e-39, 1e-30, 1e-8, 1e-6])
admitted = st.fixed_dictionaries({
    "temperature": st.one_of(st.floats(0, 2), tiny),
    "top_p": st.one_of(st.floats(0, 1, exclude_min=True), tiny),
    "top_k": st.integers(-1, 60),
    "min_p": st.one_of(st.floats(0, 1), tiny),
    "repetition_penalty": st.one_of(st.floats(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
                                    st.sampled_from([MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY])),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
})
logit_values = st.one_of(st.floats(-1e4, 1e4), st.just(float("-inf")))


@settings(max_examples=400, deadline=None)
@given(params=admitted, values=st.lists(logit_values, min_size=2, max_size=60), history=st.lists(st.integers(0, 59)))
def test_every_admitted_parameter_gives_a_finite_distribution(params, values, history):
    logits = torch.tensor(values)
    if not torch.isfinite(logits).any():
        logits[0] = 0.0  # a model's logits have a finite entry
    history = [t % logits.numel() for t in history]
    row = SamplingRow(SamplingParams(**params), history[:3], history[3:])
    probs = sampling_distribution(logits, row)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert abs(float(probs.sum()) - 1) < 1e-4
    assert int(torch.multinomial(probs, 1)) < logits.numel()


def test_temperatures_below_the_greedy_bound_are_greedy():
    assert SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE).greedy


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_parameters_are_refused(bad):
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: bad})


def test_logits_that_are_not_finite_raise_a_sampling_error_not_nan():
    row = SamplingRow(SamplingParams(temperature=0.8), [], [])
    for poisoned in (float("nan"), float("inf")):
        logits = torch.zeros(8)
        logits[3] = poisoned
        with pytest.raises(SamplingError, match="not finite"):
            sampling_distribution(logits, row)


def test_rows_filtered_together_keep_their_own_parameters():
    """A batch mixes rows with and without each filter: a row without one keeps every token it
    would keep alone (summing 49k float32 probabilities must not drop its tail)."""
    from specserve.sampling import filter_rows

    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(0)) * 2
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50), SamplingParams(temperature=0.8),
              SamplingParams(temperature=0.8, min_p=0.1)]
    together = filter_rows(logits, params)
    for row, p in enumerate(params):
        assert torch.equal(together[row], filter_logits(logits[row], p))
    assert torch.isfinite(together[1]).all()
