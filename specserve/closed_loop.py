"""Driving an engine the way a serving benchmark's clients do: a closed loop.

`concurrency` clients each send their next prompt as soon as their last one finished, so the
engine always has that many requests in flight until the prompts run out. The benchmarks, the
ablation runner and the drafter-training data generation all drive the engine through this.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine's module loads the model code; a loop only calls its methods
    from specserve.engine import LLMEngine
    from specserve.outputs import RequestOutput
    from specserve.sampling import SamplingParams


class ClosedLoop:
    """Prompts sent to an engine all at once, or, with `concurrency`, by that many clients.
    `busy_s`: the time spent in this engine's calls (so loops on several engines stepped in
    turn are each timed by their own work).

    With `tokens` (or `steps`), the clients never run out (they cycle through the prompts) and
    the loop is done once the engine generated that many tokens (took that many steps); the
    requests still running are then aborted. That measures the steady state at `concurrency`
    requests in flight: a fixed list run to completion ends in a drain, where the clients with
    the slowest requests are the only ones left, and that drain sets the time of the whole run.

    `params` may be a function of the request's number (0, 1, ...: e.g. lengths that vary by
    request, the same for every engine given the same function)."""

    PREFIX = "loop-"

    def __init__(self, engine: LLMEngine, prompts: list[list[int]],
                 params: SamplingParams | Callable[[int], SamplingParams] | None,
                 concurrency: int | None = None, tokens: int | None = None, steps: int | None = None):
        start = time.perf_counter()
        self.engine, self.params, self.prompts = engine, params, prompts
        self.target, self.max_steps = tokens, steps
        self.sent, self.generated, self.steps = 0, 0, 0
        self.finished: list[RequestOutput] = []  # in the order they finished
        self.aborted: list[RequestOutput] = []
        self._running: set[str] = set()
        self.closed = False  # `close`d: the clients send nothing more
        for _ in range(min(concurrency or len(prompts), len(prompts))):
            self._submit()
        self.busy_s = time.perf_counter() - start

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished()

    def step(self) -> None:
        start = time.perf_counter()
        self.steps += 1
        for output in self.engine.step():
            self.generated += sum(len(c.delta_token_ids) for c in output.outputs)
            if output.finished:
                self.finished.append(output)
                self._running.discard(output.request_id)
                if not self.closed and (self.endless or self.sent < len(self.prompts)):
                    self._submit()
        self.busy_s += time.perf_counter() - start
        if (self.target is not None and self.generated >= self.target) or self.steps == self.max_steps:
            self.stop()

    @property
    def endless(self) -> bool:
        """Whether the clients cycle through the prompts until a token or step limit stops them."""
        return self.target is not None or self.max_steps is not None

    def close(self) -> None:
        """The clients send nothing more; the requests in flight run to completion (then `done`)."""
        self.closed = True

    def stop(self) -> None:
        """Abort the requests still running (their blocks freed, their outputs in `aborted`): the
        loop is done, as no request of it is left to finish and send the next."""
        self.aborted += [out for rid in sorted(self._running) if (out := self.engine.abort(rid))]
        self._running.clear()

    def number(self, output: RequestOutput) -> int:
        """Which request `output` is (0, 1, ...; request k ran prompt k mod len(prompts))."""
        return int(output.request_id.removeprefix(self.PREFIX))

    def _submit(self) -> None:
        request_id = f"{self.PREFIX}{self.sent}"
        params = self.params(self.sent) if callable(self.params) else self.params
        self.engine.add_request(request_id, self.prompts[self.sent % len(self.prompts)], params)
        self._running.add(request_id)
        self.sent += 1


def run_to_completion(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                      concurrency: int | None = None) -> tuple[list[RequestOutput], float, float]:
    """Run every prompt to completion (see `ClosedLoop`): (outputs in prompt order, start time,
    wall seconds)."""
    start = time.perf_counter()
    loop = ClosedLoop(engine, prompts, params, concurrency)
    while not loop.done:
        loop.step()
    return sorted(loop.finished, key=loop.number), start, time.perf_counter() - start
