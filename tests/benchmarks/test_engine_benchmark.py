"""benchmarks/engine.py's helpers that decide what a measurement means."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from types import SimpleNamespace  # noqa: E402

from engine import ClosedLoop, cpu_ticks, run_interleaved, steal_share  # noqa: E402  (benchmarks/engine.py)


class CountingEngine:
    """Every running request gains one token per step and finishes after as many as its
    prompt's first id says."""

    def __init__(self):
        self.running: dict[str, list[int]] = {}  # request id -> [tokens so far, length]
        self.in_flight: list[int] = []  # requests running at each step

    def add_request(self, request_id, prompt, params):
        self.running[request_id] = [0, prompt[0]]

    def has_unfinished(self):
        return bool(self.running)

    def abort(self, request_id):
        self.running.pop(request_id)
        return SimpleNamespace(request_id=request_id, outputs=[], finished=True)

    def step(self):
        self.in_flight.append(len(self.running))
        outputs = []
        for rid, state in list(self.running.items()):
            state[0] += 1
            if state[0] == state[1]:
                del self.running[rid]
            outputs.append(SimpleNamespace(request_id=rid, finished=state[0] == state[1],
                                           outputs=[SimpleNamespace(delta_token_ids=[7])]))
        return outputs


def test_steal_share_is_the_stolen_part_of_all_cpu_time_between_two_readings():
    #         user nice system idle iowait irq softirq steal
    before = [1000, 0, 100, 5000, 0, 0, 0, 10]
    after = [1090, 0, 110, 5000, 0, 0, 0, 50]  # 140 ticks went by, 40 of them stolen
    assert steal_share(before, after) == 40 / 140


def test_steal_share_is_zero_without_counters_or_time():
    assert steal_share([], []) == 0.0
    assert steal_share([1] * 8, [1] * 8) == 0.0


def test_cpu_ticks_reads_the_steal_column_where_there_is_proc():
    ticks = cpu_ticks()
    if Path("/proc/stat").exists():
        assert len(ticks) > 7 and all(t >= 0 for t in ticks)
    else:
        assert ticks == []


def test_a_closed_loop_runs_its_prompts_to_completion_with_at_most_c_in_flight():
    engine = CountingEngine()
    loop = ClosedLoop(engine, [[3], [1], [2], [5]], params=None, concurrency=2)
    run_interleaved([loop])
    assert sorted(o.request_id for o in loop.finished) == ["b0", "b1", "b2", "b3"]
    assert loop.generated == 3 + 1 + 2 + 5 and not loop.aborted
    assert max(engine.in_flight) == 2 and engine.in_flight[-1] == 1  # the drain: one client left


def test_with_a_token_target_the_clients_never_run_out_and_the_rest_is_aborted():
    engine = CountingEngine()
    loop = ClosedLoop(engine, [[3], [1]], params=None, concurrency=2, tokens=9)
    run_interleaved([loop])
    assert set(engine.in_flight) == {2}  # steady state: both clients busy at every step
    assert loop.generated == 10  # the step that crossed 9 generated two
    assert loop.done and not engine.running and [o.request_id for o in loop.aborted]
