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


# -- engine loops (one call for the whole loop, `loop_value` per iteration) against the generic sections --

A = Node("a", inputs={"x": "x", "y": "y"}, outputs={"x": "x", "s": "sa"})
B = Node("b", inputs={"y": "y"}, outputs={"y": "y", "s": "sb"})
C = Node("c", inputs={"x": "x", "y": "y"}, outputs={"z": "z"})
D = Node("d", inputs={"y": "y"}, outputs={"z": "z"})
A_ALONE = Node("a", inputs={"x": "x"}, outputs={"x": "x", "s": "sa"})
SECTIONS = {  # members of a Parallel read no edge another member writes: their rounds may differ
    "loop beside a branch": Parallel(Loop(A, max_iterations=6, name="la"), Sequential(B, D)),
    "two loops side by side": Parallel(Loop(A_ALONE, max_iterations=5, name="la"),
                                       Loop(B, max_iterations=3, name="lb")),
    "nested, accumulated": Loop(Sequential(Loop(A, max_iterations=4, name="la", accumulate=("sa",)), C),
                                max_iterations=3, name="outer", accumulate=("z",)),
    "loops one after another": Sequential(Loop(A, max_iterations=3, name="la"), Loop(B, max_iterations="n", name="lb"),
                                          C),
    "stopped early": Sequential(Loop(A, max_iterations=50, name="la"), C),
}


def _answer(node: Node, iteration: int, inputs: dict) -> Outcome:
    """Deterministic outputs from the inputs; `a` asks to stop once x passes 40."""
    total = sum(int(v.sum()) for v in inputs.values())
    value = torch.tensor([total % 23 + iteration])
    outputs = {port: value + i for i, (port, _) in enumerate(node.outputs)}
    stop = node.name == "a" and total > 40
    return Outcome(outputs, stop, "stop" if stop else None)


class _EngineCall:
    """An engine loop as its engine runs it: iterations fed their own outputs through the node's loop-back
    edges, the other inputs kept."""

    def __init__(self, call) -> None:
        self.node, self.inputs, self.limit, self.iteration = call.node, dict(call.inputs), call.loop.max_iterations, 0

    def run_one(self) -> tuple[int, dict, Outcome, bool]:
        """One iteration: (its index, its inputs, its outcome, whether the loop goes on)."""
        iteration, inputs = self.iteration, self.inputs
        outcome = _answer(self.node, iteration, inputs)
        produced = {edge: outcome.outputs[port] for port, edge in self.node.outputs}
        self.inputs = {port: produced.get(edge, inputs.get(port)) for port, edge in self.node.inputs}
        self.iteration += 1
        return iteration, inputs, outcome, not outcome.stop and self.iteration < self.limit


def _drive_all(section, engine_loops: bool, seed: int) -> tuple[list, list, tuple]:
    """Answer one iteration of a waiting call at a time, in an order a seeded generator picks by node
    name; with `engine_loops`, every one-node loop is one call whose iterations go through `loop_value`
    but the last (its other inputs read once, at the start: no section here changes them meanwhile)."""
    import random

    from mstar.graph import iter_loops

    pick = random.Random(seed)
    seen: list = []
    loops = frozenset(id(loop) for loop in iter_loops(section) if isinstance(loop.body, Node)) if engine_loops \
        else frozenset()
    run = WalkRun(section, {"n": 4}, {"x": torch.tensor([1]), "y": torch.tensor([2])}, frozenset(),
                  lambda edge, value: seen.append((edge, value.tolist())), loops)
    waiting = {c.node.name: (_EngineCall(c) if c.loop else c) for c in run.start()}
    made = []
    while waiting:
        name = pick.choice(sorted(waiting))
        call = waiting[name]
        if isinstance(call, _EngineCall):
            iteration, inputs, outcome, more = call.run_one()
        else:
            iteration, inputs, outcome, more = call.iteration, call.inputs, _answer(call.node, call.iteration,
                                                                                     call.inputs), False
        made.append((name, iteration, {k: v.tolist() for k, v in inputs.items()}))
        if more:
            run.loop_value(name, outcome.outputs)
            continue
        del waiting[name]
        for c in run.complete(name, outcome):
            waiting[c.node.name] = _EngineCall(c) if c.loop else c
    env = {k: v.tolist() for k, v in run.env.items()}
    calls, values = {}, {}  # per node and per edge, in order: an engine loop is one call of its round
    for name, iteration, inputs in made:
        calls.setdefault(name, []).append((iteration, inputs))
    for edge, value in seen:
        values.setdefault(edge, []).append(value)
    return calls, values, (run.done, run.stopped, run.finish_reason, env)


@pytest.mark.parametrize("name", sorted(SECTIONS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_loops_match_the_generic_sections(name, seed):
    engine, generic = _drive_all(SECTIONS[name], True, seed), _drive_all(SECTIONS[name], False, seed)
    assert engine == generic
    assert engine[2][0]  # the walk ran to its end


def test_an_engine_loop_is_one_call_with_its_bound():
    """The call carries the loop's bound (from the options here); `loop_value` records an iteration as
    `complete` would (values out, accumulation), and a zero bound makes no call at all."""
    loop = Loop(STEP, max_iterations="steps", accumulate=("token",))
    seen = []
    run = WalkRun(loop, {"steps": 3}, {"token": torch.tensor([0]), "prompt": torch.tensor([7])}, frozenset(),
                  lambda edge, value: seen.append((edge, value.tolist())), frozenset({id(loop)}))
    (call,) = run.start()
    assert call.loop is not None and call.loop.max_iterations == 3 and int(call.inputs["input_ids"]) == 0
    run.loop_value("llm", {"token": torch.tensor([1])})
    run.loop_value("llm", {"token": torch.tensor([2])})
    assert seen == [] and not run.done  # accumulated: nothing out before the loop ends
    assert run.complete("llm", Outcome({"token": torch.tensor([3])})) == [] and run.done
    assert seen == [("token", [1, 2, 3])] and run.finish_reason == "length"
    zero = Loop(STEP, max_iterations=0)
    run = WalkRun(zero, {}, {"token": torch.tensor([0]), "prompt": torch.tensor([7])}, frozenset(),
                  lambda e, v: None, frozenset({id(zero)}))
    assert run.start() == [] and run.done


def test_the_graph_names_its_engine_loops():
    """`ModelGraph.engine_loop`: one autoregressive node feeding `token` into `input_ids`, no other
    loop-back edge, no stream input; the shipped decode walks qualify, multi-node loops do not."""
    from mstar.graph import ComponentSpec, Lane, ModelGraph, StreamEdge, Walk, iter_loops
    from mstar.graph.chunking import Fixed

    other = Node("llm", inputs={"input_ids": "token", "state": "state"}, outputs={"token": "token", "s": "state"},
                 name="other")
    streamed = Node("llm", inputs={"input_ids": "token", "codes": "codes"}, outputs={"token": "token"}, name="streamed")
    mapped = Node("llm", inputs={"input_ids": "prompt", "p": "token"}, outputs={"token": "token"}, name="mapped")
    loops = {n.name: Loop(n, max_iterations=3, name=n.name) for n in (STEP, other, streamed, mapped)}
    loops["sequential"] = Loop(Sequential(STEP), max_iterations=3, name="sequential")
    loops["stateless"] = Loop(Node("vae", inputs={"input_ids": "token"}, outputs={"token": "token"}), max_iterations=3)
    walks = tuple(Walk(name, "lm", loop, inputs=("token", "prompt", "state", "codes")) for name, loop in loops.items())
    graph = ModelGraph({"llm": ComponentSpec("autoregressive"), "vae": ComponentSpec("stateless")}, walks,
                       (Lane("lm", "llm"),), (StreamEdge("token", "other", "streamed", "codes", Fixed(1)),))
    found = {w.name for w in walks for loop in iter_loops(w.body) if graph.engine_loop(w, loop)}
    assert found == {"llm"}

    from mstar.models.registry import get_model_class  # the shipped decode loops

    for name in ("llama", "orpheus", "qwen3_omni"):
        cls = get_model_class(name)
        g = cls(cls.make_config(tiny=True)).graph()
        engine_loops = {(w.name, lp.name) for w in g.walks for lp in iter_loops(w.body) if g.engine_loop(w, lp)}
        assert engine_loops == {("decode", "decode")}, name
