"""The time budget `train-drafter` runs under: it stops a run between units of saved work."""

from __future__ import annotations

import time

import pytest

from specserve.training.budget import Budget, BudgetSpent


def test_no_budget_is_never_spent():
    budget = Budget()
    budget.check("answers", "1 of 2")
    assert not budget.spent


def test_a_spent_budget_stops_the_run_naming_the_stage_and_how_to_go_on():
    budget = Budget(0.01)
    budget.check("answers", "0 of 2")  # not yet
    time.sleep(0.02)
    with pytest.raises(BudgetSpent, match="stage 'states' \\(3 of 8 answers recorded\\).*run the same command again"):
        budget.check("states", "3 of 8 answers recorded")


@pytest.mark.parametrize("seconds", [0, -5])
def test_a_budget_must_be_positive(seconds):
    with pytest.raises(ValueError, match="must be positive"):
        Budget(seconds)
