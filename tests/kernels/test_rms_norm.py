"""The C++ fp32 RMSNorm: transformers' formula, each row as if alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import native


def test_equals_the_formula_to_float_rounding():
    x, weight = torch.randn(7, 576) * 3, torch.randn(576)
    expected = weight.double() * F.rms_norm(x.double(), (576,), eps=1e-5)
    torch.testing.assert_close(native.rms_norm(x, weight, 1e-5).double(), expected, atol=1e-5, rtol=1e-5)


def test_a_row_does_not_depend_on_the_others():
    x, weight = torch.randn(40, 100) * torch.logspace(-3, 3, 40).unsqueeze(1), torch.randn(100)
    together = native.rms_norm(x, weight, 1e-6)
    assert all(torch.equal(native.rms_norm(x[i : i + 1], weight, 1e-6)[0], together[i]) for i in range(40))


def test_zero_rows_give_zeros_not_nans():
    assert torch.equal(native.rms_norm(torch.zeros(2, 64), torch.ones(64), 1e-6), torch.zeros(2, 64))
