"""Engine configuration: memory budgets and budgets that would starve sequences are refused."""

from __future__ import annotations

import pytest

from specserve.config import EngineConfig, available_memory, parse_memory


@pytest.mark.parametrize("value, expected", [
    (1000, 1000), ("1000", 1000), ("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("1.5 KiB", 1536), ("64mib", 64 * 2**20),
])
def test_memory_in_bytes(value, expected):
    assert parse_memory(value) == expected


def test_memory_as_a_fraction_of_available():
    assert abs(parse_memory(0.5) - available_memory() / 2) < available_memory() * 0.05
    assert parse_memory("0.25") > 0


@pytest.mark.parametrize("value, message", [
    ("lots", "give bytes"), (0.0, "fraction must be in (0, 1]"), (1.5, "fraction must be in (0, 1]"),
    (-5, "must be positive"), ("3XB", "give bytes"),
])
def test_bad_memory_is_refused_with_a_hint(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_memory(value)


def test_token_budget_must_cover_every_running_sequence():
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be at least max_num_seqs"):
        EngineConfig(max_num_seqs=32, max_num_batched_tokens=16)
