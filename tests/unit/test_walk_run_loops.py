"""WalkRun on loops whose body is one node (a decode loop: run without a generator per iteration) and
on the same loops with a Sequential body (the general path): same calls, values, stops and reasons."""

import pytest
import torch

from mstar.graph import Loop, Node, Parallel, Sequential
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


# -- the fast path (`next_iteration`) against the generic sections ------------------------------------

A = Node("a", inputs={"x": "x", "y": "y"}, outputs={"x": "x", "s": "sa"})
B = Node("b", inputs={"y": "y"}, outputs={"y": "y", "s": "sb"})
C = Node("c", inputs={"x": "x", "y": "y"}, outputs={"z": "z"})
SECTIONS = {
    "loop beside a branch": Parallel(Loop(A, max_iterations=6, name="la"), Sequential(B, C)),
    "two loops side by side": Parallel(Loop(A, max_iterations=5, name="la"), Loop(B, max_iterations=3, name="lb")),
    "nested, accumulated": Loop(Sequential(Loop(A, max_iterations=4, name="la", accumulate=("sa",)), C),
                                max_iterations=3, name="outer", accumulate=("z",)),
    "loops one after another": Sequential(Loop(A, max_iterations=3, name="la"), Loop(B, max_iterations="n", name="lb"),
                                          C),
    "stopped early": Sequential(Loop(A, max_iterations=50, name="la"), C),
}


def _answer(call) -> Outcome:
    """Deterministic outputs from the inputs; `a` asks to stop once x passes 40."""
    total = sum(int(v.sum()) for v in call.inputs.values())
    value = torch.tensor([total % 23 + call.iteration])
    outputs = {port: value + i for i, (port, _) in enumerate(call.node.outputs)}
    stop = call.node.name == "a" and total > 40
    return Outcome(outputs, stop, "stop" if stop else None)


def _drive_all(section, fast: bool, seed: int) -> tuple[list, list, tuple]:
    """Answer the waiting calls one at a time, in an order a seeded generator picks by node name; with
    `fast`, as the worker does: `next_iteration` first, `complete` when it declines."""
    import random

    pick = random.Random(seed)
    seen: list = []
    run = WalkRun(section, {"n": 4}, {"x": torch.tensor([1]), "y": torch.tensor([2])}, frozenset(),
                  lambda edge, value: seen.append((edge, value.tolist())), node_loops=fast)
    waiting = {c.node.name: c for c in run.start()}
    made = [(c.node.name, c.iteration, {k: v.tolist() for k, v in c.inputs.items()}) for c in waiting.values()]
    while waiting:
        name = pick.choice(sorted(waiting))
        call = waiting.pop(name)
        outcome = _answer(call)
        nxt = run.next_iteration(name, outcome.outputs, outcome.stop) if fast else None
        calls = [nxt] if nxt is not None else run.complete(name, outcome)
        for c in calls:
            waiting[c.node.name] = c
            made.append((c.node.name, c.iteration, {k: v.tolist() for k, v in c.inputs.items()}))
    env = {k: v.tolist() for k, v in run.env.items()}
    return made, seen, (run.done, run.stopped, run.finish_reason, env)


@pytest.mark.parametrize("name", sorted(SECTIONS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_next_iteration_matches_the_generic_sections(name, seed):
    fast, generic = _drive_all(SECTIONS[name], True, seed), _drive_all(SECTIONS[name], False, seed)
    assert fast == generic
    assert fast[2][0]  # the walk ran to its end


def test_next_iteration_declines_what_it_must_leave_to_complete():
    """It runs only an iteration that goes on, of the one call waiting, with no outcome of its round
    held back; the declined outcome is then recorded by `complete` as usual."""
    run = WalkRun(Parallel(Loop(A, max_iterations=3, name="la"), B), {}, {"x": torch.tensor([1]),
                  "y": torch.tensor([2])}, frozenset(), lambda e, v: None)
    a0, b0 = run.start()
    out = {"x": torch.tensor([5]), "s": torch.tensor([0])}
    assert run.next_iteration("a", out, False) is None  # two calls wait
    assert run.complete("b", Outcome({"y": torch.tensor([3])})) == []
    assert run.next_iteration("a", out, False) is None  # b's outcome waits for a's: the round is not over
    (a1,) = run.complete("a", Outcome(out))
    assert a1.iteration == 1 and int(a1.inputs["x"]) == 5
    assert run.next_iteration("a", out, True) is None  # a stop ends the loop: complete's job
    a2 = run.next_iteration("a", {"x": torch.tensor([6])}, False)
    assert a2 is a1 and a2.iteration == 2 and int(a2.inputs["x"]) == 6 and int(a2.inputs["y"]) == 3
    assert run.next_iteration("a", out, False) is None  # the last iteration
    assert run.complete("a", Outcome(out)) == [] and run.done and run.finish_reason == "length"
    assert run.next_iteration("a", out, False) is None  # nothing waits any more
