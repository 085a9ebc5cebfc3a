"""WalkRun on loops whose body is one node (a decode loop: run without a generator per iteration) and
on the same loops with a Sequential body (the general path): same calls, values, stops and reasons."""

import pytest
import torch

from mstar.graph import Loop, Node, Sequential
from mstar.worker.walk_run import Outcome, WalkRun

STEP = Node("llm", inputs={"input_ids": "token", "prompt_ids": "prompt"}, outputs={"token": "token"})


def _body(single: bool):
    return STEP if single else Sequential(STEP)


def _drive(loop: Loop, stop_at: int | None = None, options: dict | None = None, streams=frozenset()):
    """Answer every call with token + 1 (stop at iteration `stop_at`); the calls, values seen, the run."""
    seen = []
    run = WalkRun(loop, options or {}, {"token": torch.tensor([0]), "prompt": torch.tensor([7, 8])}, streams,
                  lambda edge, value: seen.append((edge, int(value.reshape(-1)[-1]))))
    calls, made = run.start(), []
    while calls:
        (call,) = calls
        made.append(call)
        token = call.inputs["input_ids"] + 1
        stop = stop_at is not None and call.iteration == stop_at
        calls = run.complete("llm", Outcome({"token": token}, stop, "stop" if stop else None))
    return made, seen, run


@pytest.mark.parametrize("single", [True, False])
def test_loop_feeds_each_output_back_and_reports_length(single):
    made, seen, run = _drive(Loop(_body(single), max_iterations=4))
    assert [c.iteration for c in made] == [0, 1, 2, 3]
    assert [int(c.inputs["input_ids"]) for c in made] == [0, 1, 2, 3]
    assert all(c.per_iteration and c.stream is None and c.node is STEP for c in made)
    assert all(torch.equal(c.inputs["prompt_ids"], torch.tensor([7, 8])) for c in made)
    assert seen == [("token", 1), ("token", 2), ("token", 3), ("token", 4)]
    assert run.done and run.finish_reason == "length" and not run.stopped
    assert int(run.env["token"]) == 4


@pytest.mark.parametrize("single", [True, False])
def test_loop_stops_when_asked_with_the_nodes_reason(single):
    made, seen, run = _drive(Loop(_body(single), max_iterations=10), stop_at=2)
    assert len(made) == 3 and seen[-1] == ("token", 3)
    assert run.done and run.finish_reason == "stop" and not run.stopped


@pytest.mark.parametrize("single", [True, False])
def test_loop_accumulates_without_emitting_each_iteration(single):
    made, seen, run = _drive(Loop(_body(single), max_iterations=3, accumulate=("token",)))
    assert len(made) == 3
    assert seen == [("token", 3)]  # once, the concatenation
    assert run.env["token"].tolist() == [1, 2, 3]


@pytest.mark.parametrize("single", [True, False])
def test_loop_bound_from_options_and_zero_iterations(single):
    made, _, run = _drive(Loop(_body(single), max_iterations="steps"), options={"steps": 2})
    assert len(made) == 2 and run.finish_reason == "length"
    made, seen, run = _drive(Loop(_body(single), max_iterations=0))
    assert made == [] and seen == [] and run.done and run.finish_reason is None


@pytest.mark.parametrize("single", [True, False])
def test_stream_input_of_a_one_node_loop_is_left_to_the_worker(single):
    reader = Node("llm", inputs={"input_ids": "token", "codes": "codes"}, outputs={"token": "token"})
    run = WalkRun(Loop(reader if single else Sequential(reader), max_iterations=2), {},
                  {"token": torch.tensor([0])}, frozenset({"codes"}), lambda e, v: None)
    (call,) = run.start()
    assert call.stream == ("codes", "codes") and call.per_iteration and set(call.inputs) == {"input_ids"}
    (call,) = run.complete("llm", Outcome({"token": torch.tensor([5])}))
    assert call.iteration == 1 and int(call.inputs["input_ids"]) == 5
    assert run.complete("llm", Outcome({"token": torch.tensor([6])})) == [] and run.done
