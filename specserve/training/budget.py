"""A time budget for `specserve train-drafter`, spread over several runs.

Every stage saves its work as it goes (prompts and answers line by line, hidden states in shards,
training at each epoch and where the budget stops it) and checks the budget only between units
it has saved. A run stopped by the budget therefore loses nothing, and the same command run again
goes on where it stopped: on a CPU a whole training run may take hours, in pieces that fit the
time a user has. A stage checks only once it has saved something in this run, so every run moves
forward, even on a budget shorter than one unit of work (it then overruns by that unit). Stages
that generate stop sending requests when the budget runs out and let those in flight finish, so
no generated token is thrown away (they overrun by the longest of those requests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


class BudgetSpent(RuntimeError):
    """The run's time budget ran out; what was done is saved, and the same command resumes it."""

    def __init__(self, stage: str, progress: str):
        self.stage, self.progress = stage, progress
        super().__init__(f"the time budget ran out in stage '{stage}' ({progress}); what was done is saved: "
                         f"run the same command again to go on")


@dataclass
class Budget:
    """`seconds` from the run's start (None: no limit)."""

    seconds: float | None = None
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.seconds is not None and self.seconds <= 0:
            raise ValueError(f"a time budget must be positive (got {self.seconds} s)")

    @property
    def spent(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.started >= self.seconds

    def check(self, stage: str, progress: str) -> None:
        """Stop the run (`BudgetSpent`) if the budget is spent; call it only with the work so far saved."""
        if self.spent:
            raise BudgetSpent(stage, progress)
