"""SwiGLU's silu(gate) * up in one C++ pass: torch's own bits, each row as if alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import native


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("width", [1, 7, 16, 24, 1536, 1543, 8960])
def test_equals_torchs_silu_times_up(rows, width):
    gate_up = torch.randn(rows, 2 * width) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    expected, ours = F.silu(gate) * up, native.silu_mul(gate_up)
    # torch's vectors are ours where it runs AVX2 code; its AVX-512 code takes runs of 32 (the rest
    # of a row by std::exp), ours of 16; a portable build uses std::exp throughout
    if native.isa() != "portable" and torch.backends.cpu.get_cpu_capability() == "AVX2":
        assert torch.equal(ours, expected)
    else:
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-7)


def test_a_row_does_not_depend_on_the_others():
    gate_up = torch.randn(40, 2 * 100) * torch.logspace(-3, 2, 40).unsqueeze(1)
    together = native.silu_mul(gate_up)
    assert all(torch.equal(native.silu_mul(gate_up[i : i + 1])[0], together[i]) for i in range(40))


def test_refuses_what_it_cannot_split_into_gate_and_up():
    with pytest.raises(RuntimeError, match="2 \\* intermediate"):
        native.silu_mul(torch.randn(2, 7))
