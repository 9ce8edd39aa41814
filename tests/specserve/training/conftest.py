from __future__ import annotations

import pytest

from specserve.training.budget import Budget


class StopsAfter(Budget):
    """Spent from its `checks + 1`-th look on: a run cut at a chosen point of its work, not of the clock."""

    def __init__(self, checks: int):
        super().__init__()
        self.left = checks

    @property
    def spent(self) -> bool:
        self.left -= 1
        return self.left < 0


@pytest.fixture
def stops_after():
    """`stops_after(n)`: a budget spent after n looks at it (`StopsAfter`)."""
    return StopsAfter
