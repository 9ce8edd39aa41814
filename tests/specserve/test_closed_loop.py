"""`ClosedLoop`: `concurrency` clients, each sending its next prompt when its last one finished."""

from __future__ import annotations

from types import SimpleNamespace

from specserve.closed_loop import ClosedLoop, run_to_completion


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


def run(loop: ClosedLoop) -> None:
    while not loop.done:
        loop.step()


def test_a_closed_loop_runs_its_prompts_to_completion_with_at_most_c_in_flight():
    engine = CountingEngine()
    loop = ClosedLoop(engine, [[3], [1], [2], [5]], params=None, concurrency=2)
    run(loop)
    assert sorted(o.request_id for o in loop.finished) == ["loop-0", "loop-1", "loop-2", "loop-3"]
    assert loop.generated == 3 + 1 + 2 + 5 and not loop.aborted
    assert max(engine.in_flight) == 2 and engine.in_flight[-1] == 1  # the drain: one client left


def test_with_a_token_target_the_clients_never_run_out_and_the_rest_is_aborted():
    engine = CountingEngine()
    loop = ClosedLoop(engine, [[3], [1]], params=None, concurrency=2, tokens=9)
    run(loop)
    assert set(engine.in_flight) == {2}  # steady state: both clients busy at every step
    assert loop.generated == 10  # the step that crossed 9 generated two
    assert loop.done and not engine.running and [o.request_id for o in loop.aborted]


def test_run_to_completion_gives_outputs_in_prompt_order_whatever_order_they_finished_in():
    outputs, _, wall = run_to_completion(CountingEngine(), [[3], [1], [2]], params=None, concurrency=3)
    assert [o.request_id for o in outputs] == ["loop-0", "loop-1", "loop-2"] and wall >= 0


def test_with_a_step_limit_the_clients_never_run_out_and_the_loop_stops_after_that_many_steps():
    engine = CountingEngine()
    loop = ClosedLoop(engine, [[3], [1]], params=None, concurrency=2, steps=7)
    run(loop)
    assert loop.steps == 7 and len(engine.in_flight) == 7 and set(engine.in_flight) == {2}
    assert loop.sent > 2 and loop.done and [o.request_id for o in loop.aborted]


def test_a_closed_loop_sends_nothing_more_and_its_requests_in_flight_finish():
    engine = CountingEngine()
    loop = ClosedLoop(engine, [[3], [1], [2], [5]], params=None, concurrency=2)
    loop.step()  # loop-1 finishes and its client sends loop-2
    loop.close()
    run(loop)
    assert sorted(o.request_id for o in loop.finished) == ["loop-0", "loop-1", "loop-2"]
    assert loop.sent == 3 and not loop.aborted and loop.generated == 3 + 1 + 2
