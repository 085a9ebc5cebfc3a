"""Interpreting one walk of one request on its driver worker.

The walk's section tree is run by a Python generator: it yields the node calls that can run now
and is resumed with their outcomes. Loops therefore live in the generator's frame on the worker,
never on the conductor; edge values live in `env` (a loop-back edge is simply the value the
previous iteration left there).

An engine loop (`ModelGraph.engine_loop`: one autoregressive node feeding its token back) is one
call carrying its `LoopSpec`: its engine runs the iterations and the worker records each one that
does not end the loop with `loop_value`, without resuming the generator; the last comes through
`complete`, as every call of other sections does.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.engines.base import LoopSpec
from mstar.graph import Loop, Node, Parallel, Section, Sequential


@dataclass(slots=True)  # one per node call (per token in a decode loop): slots are cheaper
class NodeCall:
    """A node of this walk that can run now."""

    node: Node
    iteration: int  # innermost loop iteration (0 outside loops)
    inputs: dict[str, Any]  # port -> tensor
    stream: tuple[str, str] | None = None  # (port, stream name): filled with one chunk at a time
    per_iteration: bool = False  # a stream call inside a Loop: one chunk, or no port once the stream ended
    loop: LoopSpec | None = None  # the call is a whole engine loop (module docstring)


@dataclass(slots=True)
class Outcome:
    """What a node call produced."""

    outputs: dict[str, Any] = field(default_factory=dict)  # port -> tensor
    stop: bool = False
    finish_reason: str | None = None
    final_chunk: bool = False  # stream calls: the stream is exhausted after this call


@dataclass(slots=True)
class _LoopContext:
    iteration: int
    accumulate: frozenset[str]
    stop: bool = False


Program = Generator[list[NodeCall], dict[str, Outcome], None]


class WalkRun:
    """One walk of one request. `start()` and `complete()` return the calls to run next."""

    def __init__(
        self,
        body: Section,
        options: Mapping[str, Any],
        inputs: Mapping[str, Any],
        stream_inputs: frozenset[str],
        on_value: Callable[[str, Any], None],
        engine_loops: frozenset[int] = frozenset(),
    ) -> None:
        self.env: dict[str, Any] = dict(inputs)
        self.options = options
        self.stopped = False  # a node outside any loop asked to stop
        self.finish_reason: str | None = None
        self.done = False
        self._streams = stream_inputs
        self._on_value = on_value
        self._program = self._run(body, None)
        self._waiting: dict[str, NodeCall] = {}
        self._outcomes: dict[str, Outcome] = {}
        # id(node) -> its (port, edge) inputs read from env, and its stream input (port, edge) if any
        self._plans: dict[int, tuple[tuple[tuple[str, str], ...], tuple[str, str] | None]] = {}
        self._engine_loops = engine_loops  # id() of the Loops of this walk that are engine loops
        # node name -> (node, iteration context, gathered values) of each engine loop running now
        self._looping: dict[str, tuple[Node, _LoopContext, dict[str, list]]] = {}

    def start(self) -> list[NodeCall]:
        return self._advance(None)

    def complete(self, node: str, outcome: Outcome) -> list[NodeCall]:
        """Record a call's outcome; once every call of the round is in, resume the program."""
        self._waiting.pop(node)
        self._outcomes[node] = outcome
        if self._waiting:
            return []
        outcomes, self._outcomes = self._outcomes, {}
        return self._advance(outcomes)

    def waiting(self, node: str) -> NodeCall | None:
        return self._waiting.get(node)

    def loop_value(self, node: str, outputs: dict[str, Any]) -> None:
        """Record one iteration of the engine loop of `node` that does not end it, as `complete` records
        an iteration of any loop (the last one comes through `complete`)."""
        spec, ctx, gathered = self._looping[node]
        self._record(spec, outputs, ctx)
        if gathered:
            self._gather(gathered)
        ctx.iteration += 1

    def _advance(self, outcomes: dict[str, Outcome] | None) -> list[NodeCall]:
        try:
            calls = self._program.send(outcomes)
        except StopIteration:
            self.done = True
            return []
        self._waiting = {c.node.name: c for c in calls}
        return calls

    def _run(self, sec: Section, ctx: _LoopContext | None) -> Program:
        if isinstance(sec, Node):
            yield from self._node(sec, ctx)
        elif isinstance(sec, Sequential):
            for member in sec.members:
                yield from self._run(member, ctx)
        elif isinstance(sec, Parallel):
            yield from self._parallel(sec.members, ctx)
        elif isinstance(sec, Loop):
            yield from self._loop(sec, ctx)

    def _node(self, node: Node, ctx: _LoopContext | None) -> Program:
        inputs, stream = self._inputs(node)
        while True:
            outcomes = yield [NodeCall(node, ctx.iteration if ctx else 0, inputs, stream, ctx is not None)]
            outcome = outcomes[node.name]
            self._take(node, outcome, ctx)
            if stream is None or ctx is not None or outcome.final_chunk:
                return  # inside a Loop a stream node takes one chunk per iteration

    def _inputs(self, node: Node) -> tuple[dict[str, Any], tuple[str, str] | None]:
        """The node's inputs from env now (port -> value), and its stream input (port, edge) if any."""
        plan = self._plans.get(id(node))  # nodes live in the graph, as long as this run
        if plan is None:
            plan = self._plans[id(node)] = (tuple((p, e) for p, e in node.inputs if e not in self._streams),
                                            next(((p, e) for p, e in node.inputs if e in self._streams), None))
        pairs, stream = plan
        env = self.env
        return {p: env[e] for p, e in pairs if e in env}, stream

    def _take(self, node: Node, outcome: Outcome, ctx: _LoopContext | None) -> None:
        """Record one call's outcome: outputs into env (and out through on_value unless a loop
        accumulates them), a stop request and its finish reason."""
        self._record(node, outcome.outputs, ctx)
        if outcome.stop:
            if ctx:
                ctx.stop = True
            else:
                self.stopped = True
            self.finish_reason = outcome.finish_reason or self.finish_reason

    def _record(self, node: Node, outputs: dict[str, Any], ctx: _LoopContext | None) -> None:
        """Outputs into env, and out through on_value unless a loop accumulates them."""
        env, on_value = self.env, self._on_value
        accumulate = ctx.accumulate if ctx else ()
        for port, edge in node.outputs:
            if port in outputs:
                value = env[edge] = outputs[port]
                if edge not in accumulate:
                    on_value(edge, value)

    def _parallel(self, members: tuple[Section, ...], ctx: _LoopContext | None) -> Program:
        """Members advance in rounds: each round runs every member's next calls together."""
        programs = [self._run(m, ctx) for m in members]
        pending = {i: c for i, p in enumerate(programs) if (c := _send(p, None)) is not None}
        while pending:
            outcomes = yield [call for calls in pending.values() for call in calls]
            after = {}
            for i, calls in pending.items():
                mine = {c.node.name: outcomes[c.node.name] for c in calls}
                if (nxt := _send(programs[i], mine)) is not None:
                    after[i] = nxt
            pending = after

    def _loop(self, loop: Loop, outer: _LoopContext | None) -> Program:
        limit = resolve_max_iterations(loop, self.options)
        accumulate = frozenset(loop.accumulate) | (outer.accumulate if outer else frozenset())
        gathered: dict[str, list] = {edge: [] for edge in loop.accumulate}
        if id(loop) in self._engine_loops and isinstance(loop.body, Node):
            stopped = yield from self._engine_loop(loop.body, limit, _LoopContext(0, accumulate), gathered)
        else:
            stopped = False
            for i in range(limit):
                ctx = _LoopContext(i, accumulate)
                yield from self._run(loop.body, ctx)
                self._gather(gathered)
                if ctx.stop:
                    stopped = True
                    break
        if not stopped and limit and not self.finish_reason:
            self.finish_reason = "length"  # the loop ran out of iterations, nobody asked it to stop
        for edge, values in gathered.items():
            if values:
                self.env[edge] = torch.cat(values)
                if not (outer and edge in outer.accumulate):
                    self._on_value(edge, self.env[edge])

    def _engine_loop(self, node: Node, limit: int, ctx: _LoopContext,
                     gathered: dict[str, list]) -> Generator[list[NodeCall], dict[str, Outcome], bool]:
        """An engine loop as one call; whether its last iteration asked it to stop. `loop_value` records
        the iterations before the last, which `complete` brings."""
        if limit == 0:
            return False
        self._looping[node.name] = (node, ctx, gathered)
        try:
            outcomes = yield [NodeCall(node, 0, self._inputs(node)[0], None, True, LoopSpec(limit))]
        finally:
            del self._looping[node.name]
        self._take(node, outcomes[node.name], ctx)
        self._gather(gathered)
        return ctx.stop

    def _gather(self, gathered: dict[str, list]) -> None:
        for edge, values in gathered.items():
            if edge in self.env:
                values.append(self.env[edge])


def _send(program: Program, value: dict[str, Outcome] | None) -> list[NodeCall] | None:
    try:
        return program.send(value)
    except StopIteration:
        return None


def resolve_max_iterations(loop: Loop, options: Mapping[str, Any]) -> int:
    """A loop's bound for one request: a number, an option's value, or a function of the options."""
    bound = loop.max_iterations
    if callable(bound):
        value = bound(options)
    elif isinstance(bound, str):
        if bound not in options:
            raise ValueError(f"loop {loop.name!r} is bounded by option {bound!r}, which the request does not set")
        value = options[bound]
    else:
        value = bound
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"loop {loop.name!r}: max iterations must be an integer >= 0, got {value!r}")
    return value
