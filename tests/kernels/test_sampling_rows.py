"""The C++ row passes of sampling: argmax as torch's, filtered distributions as `filter_rows`
defines them, draws by inverse CDF."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from specserve.sampling import FilterStats, SamplingParams, filter_columns, filter_rows, filter_stats_reference

VOCAB = 1000


def native_stats(scores: torch.Tensor, params: list[SamplingParams]) -> FilterStats:
    return FilterStats(*native.op("filter_stats")(scores, *filter_columns(params)))


def test_argmax_is_torchs_first_index_of_the_max_nans_included():
    x = torch.randn(37, VOCAB)
    x[3, 10] = x[3, 500] = 100.0  # ties: the first
    x[5, 7], x[5, 3] = float("nan"), float("nan")  # NaN counts as the max: the first NaN
    x[6] = float("-inf")
    x[8, :] = 2.0
    values, indices = native.op("row_argmax")(x)
    assert torch.equal(indices, x.argmax(-1))
    assert torch.equal(values[~values.isnan()], x.max(-1).values[~values.isnan()]) and values[5].isnan()


FILTERS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=0.5, top_k=50, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=2.0, top_p=1e-9),  # the likeliest token alone
    SamplingParams(temperature=1.0, top_p=5e-324),  # 0 in float32: still the likeliest token
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.8, top_k=10**30, top_p=0.3),  # a k past int64 keeps every token
]


@pytest.mark.parametrize("params", FILTERS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_filtered_distributions_are_filter_rows_ones(params):
    scores = torch.randn(24, VOCAB) * torch.linspace(0.5, 6, 24)[:, None]  # flat to peaked rows
    scores[2, 100:110] = scores[2].max()  # ties at the top
    got, want = native_stats(scores, [params] * 24), filter_stats_reference(scores, [params] * 24)
    temperature = torch.full((24,), params.temperature)
    assert torch.equal(got.threshold, want.threshold)  # the same tokens kept: an exact score
    torch.testing.assert_close(got.log_norm, want.log_norm, atol=1e-5, rtol=1e-5)
    expected = filter_rows(scores, [params] * 24).softmax(-1)
    torch.testing.assert_close(got.probabilities(scores, temperature), expected, atol=1e-6, rtol=1e-4)
    assert got.finite.all()


def test_rows_without_a_distribution_say_so():
    scores = torch.randn(4, VOCAB)
    scores[0, 5] = float("nan")
    scores[1, 9] = float("inf")
    scores[2] = float("-inf")
    got = native_stats(scores, [SamplingParams(temperature=1.0)] * 4)
    assert got.finite.tolist() == [False, False, False, True]
    assert torch.equal(got.finite, filter_stats_reference(scores, [SamplingParams(temperature=1.0)] * 4).finite)


def test_draws_follow_the_filtered_distribution_without_the_excluded_tokens():
    torch.manual_seed(0)
    scores = torch.randn(1, 12) * 2
    params = [SamplingParams(temperature=0.8, top_k=6)]
    stats = native_stats(scores, params)
    excluded = torch.tensor([[scores[0].argmax().item(), -1]])  # the likeliest was tried and rejected
    draws = 40_000
    uniform = torch.rand(draws)
    tokens = native.op("sample_rows")(scores, torch.zeros(draws, dtype=torch.int64), torch.full((draws,), 0.8),
                                      stats.threshold.expand(draws), stats.log_norm.expand(draws),
                                      excluded.expand(draws, 2), uniform)
    p = filter_rows(scores, params).softmax(-1)[0]
    p[excluded[0, 0]] = 0
    p /= p.sum()
    counts = torch.bincount(tokens, minlength=12).double()
    assert counts[p == 0].sum() == 0  # never a filtered or excluded token
    expected = p.double() * draws
    chi2 = (((counts - expected) ** 2) / expected.clamp(min=1e-12))[p > 0].sum().item()
    assert chi2 < 25.0  # 4 degrees of freedom: p ~ 5e-5


def test_excluding_every_kept_token_draws_from_the_whole_distribution_again():
    scores = torch.tensor([[5.0, 4.0, -10.0, -10.0]])
    stats = native_stats(scores, [SamplingParams(temperature=1.0, top_k=2)])
    drawn = native.op("sample_rows")(scores, torch.zeros(2, dtype=torch.int64), torch.ones(2),
                                     stats.threshold.expand(2), stats.log_norm.expand(2),
                                     torch.tensor([[0, 1], [0, 1]]), torch.tensor([0.1, 0.99]))
    assert drawn.tolist() == [0, 1]
