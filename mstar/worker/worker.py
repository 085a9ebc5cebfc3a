"""A worker: owns one device and the components placed on it.

Its loop is four named steps: receive messages, hand ready node calls to engines (schedule),
let each busy engine run one batched step (execute), and route the results (to the next node,
another worker, the client, or the conductor).

An engine loop (`ModelGraph.engine_loop`) is submitted once, with its `LoopSpec`; the engine's
results for its iterations but the last (`more=True`) only have their values recorded and emitted
(`WalkRun.loop_value`, or a NodeDone with `more` to the driving worker), the last one resumes the walk.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from mstar import envs
from mstar.engines.base import Engine, LoopSpec, StepItem, StepResult
from mstar.engines.cuda_graphs import to_device_async
from mstar.graph import CARRY, TO_CLIENT, ModelGraph, Walk, iter_loops, iter_nodes
from mstar.transport import wire
from mstar.transport.messages import discard_message
from mstar.worker.kv_moves import KVMoves
from mstar.worker.outputs import BatchingOutbox
from mstar.worker.replica import follower_items, run_component_step
from mstar.worker.stats import StatsReporter, stall_dump
from mstar.worker.streams import END, StreamBuffer
from mstar.worker.walk_run import NodeCall, Outcome, WalkRun

logger = logging.getLogger(__name__)

# host inputs up to this size go to a CUDA engine through pinned memory (non-blocking); larger ones
# (whole videos) copy directly, so the pinned-memory cache does not grow with them
_PINNED_COPY_BYTES = 16 << 20
CONDUCTOR = "conductor"


def worker_peer(rank: int) -> str:
    return f"worker-{rank}"


def scoped_options(options: dict[str, Any], namespace: str) -> dict[str, Any]:
    """The options a component of `namespace` sees: plain keys, with "<namespace>.<key>" overriding "<key>";
    keys of other namespaces are left out."""
    prefix = namespace + "."
    plain = {k: v for k, v in options.items() if "." not in k}
    return {**plain, **{k[len(prefix):]: v for k, v in options.items() if k.startswith(prefix)}}


_SCALARS: dict[tuple[int, type], torch.Tensor] = {}  # (value, int or bool) -> 0-d CPU tensor, read-only
_MAX_CACHED_SCALAR = 1 << 16


def _scalar(value: int | bool) -> torch.Tensor:
    """torch.tensor(value), cached for small values: stream ports get three per chunk, and torch.tensor
    costs far more than a dict lookup. Components read these inputs and never write them (inputs are shared, as in-process)."""
    key = (value, type(value))
    cached = _SCALARS.get(key)
    if cached is None:
        cached = torch.tensor(value)
        if -_MAX_CACHED_SCALAR < value < _MAX_CACHED_SCALAR and len(_SCALARS) < _MAX_CACHED_SCALAR:
            _SCALARS[key] = cached
    return cached



@dataclass(slots=True)
class _Target:
    """Where the items of one (walk, node) go on this worker."""

    engine: Engine
    host_inputs: bool  # the engine reads inputs as produced: no device copy
    namespace: str | None  # option namespace of the component
    kv_slot: str
    pending: dict[str, int]  # the component's unanswered items per request (Worker._pending)
    component: str


@dataclass(slots=True)
class _Out:
    """Where the values of one produced edge of one walk run go: the client, a stream, or both."""

    names: tuple[str, ...]  # client output names
    rank: int = -1  # the stream's consumer rank (-1: no stream)
    stream: str = ""
    first: int = 0  # seq of the walk's first item in the stream
    sent: int = 0  # items this walk put in the stream
    buffer: StreamBuffer | None = None  # the consumer's buffer when it is on this worker


@dataclass
class _Run:
    """A walk this worker drives."""

    start: wire.StartWalk
    walk: Walk
    run: WalkRun | None = None
    outs: dict[str, _Out] = field(default_factory=dict)  # produced edge -> where its values go

    def stream_counts(self) -> dict[str, int]:
        """Stream -> items this walk produced (streams it fed at all)."""
        return {o.stream: o.sent for o in self.outs.values() if o.sent}


class Worker:
    """Drives walks and runs node steps for the components on one device."""

    def __init__(self, rank: int, graph: ModelGraph, engines: dict[str, Engine], inbox, outbox, codec,
                 device: torch.device) -> None:
        self.rank = rank
        self.graph = graph
        # stepped in the graph's data-flow order, so a multi-component loop advances once per pass
        self.engines = {name: engines[name] for name in graph.step_order() if name in engines}
        self.engines.update((name, engine) for name, engine in engines.items() if name not in self.engines)
        self.inbox, self.codec = inbox, codec
        self.outbox = BatchingOutbox(outbox, CONDUCTOR)  # client outputs leave once per step, not per value
        self.device = device
        self._walks = {w.name: w for w in graph.walks}
        self._streams = {s.target_input: s for s in graph.streams}
        self._namespaces = {n: c.option_namespace for n, c in graph.components.items() if c.option_namespace}
        self._scoped: dict[tuple[str, str], dict] = {}  # (rid, namespace) -> the options its steps see
        self._runs: dict[tuple[str, str], _Run] = {}
        self._remote: dict[tuple[str, str, str, int], int] = {}  # (rid, walk, node, iteration) -> reply rank
        # component -> rid -> items submitted to its engine and not answered yet: whom a crash concerns
        self._pending: dict[str, dict[str, int]] = {name: {} for name in engines}
        self._buffers: dict[tuple[str, str], StreamBuffer] = {}
        self._blocked: dict[tuple[str, str], tuple[str, NodeCall]] = {}  # stream -> (walk, call)
        self._released: set[str] = set()
        self._final_chunks: set[tuple[str, str, str]] = set()  # calls fed the last chunk of their stream
        # walk -> id() of its Loops that are engine loops (module docstring)
        self._engine_loops = {w.name: frozenset(id(loop) for loop in iter_loops(w.body) if graph.engine_loop(w, loop))
                              for w in graph.walks}
        self.stall_dump_s = envs.stall_dump_s()  # MSTAR_STALL_DUMP_S: stacks of a step that runs longer
        self._node_specs = {(w.name, n.name): n for w in graph.walks for n in iter_nodes(w.body)}
        # (walk, node) -> how its items reach an engine: looked up once per node, not once per token
        self._targets: dict[tuple[str, str], _Target] = {}
        # (walk, edge) -> names under which the edge's values go to the client
        self._client_emits = {(w.name, e.edge): tuple(x.name for x in w.emits if x.edge == e.edge and x.to == TO_CLIENT)
                              for w in graph.walks for e in w.emits}
        self._running = True
        self.stats = StatsReporter(rank, engines, lambda msg: self.outbox.send(CONDUCTOR, msg))
        self.kv_moves = KVMoves(rank, engines, lambda to, msg: self.outbox.send(worker_peer(to), msg), codec,
                                self._to_device)  # prefill/decode disaggregation

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until a Shutdown message arrives; engine stats go to the conductor about twice a second,
        and at once when the worker turns busy or idle; K/V offers queued here past their deadline are
        declined (checked each pass: after each engine step, every 50 ms when idle)."""
        engines = list(self.engines.values())
        while self._running:
            busy = any(e.has_work() for e in engines)
            self.receive(timeout_s=0.0 if busy else 0.05)
            self.execute()
            self.kv_moves.expire_offers(time.monotonic())
            self.stats.maybe_send(busy=any(e.has_work() for e in engines))

    def receive(self, timeout_s: float) -> None:
        msg = self.inbox.recv(timeout_s)
        while msg is not None:
            try:
                self.handle(msg)
            except Exception as exc:  # a bad message fails its request, never the worker
                logger.exception("worker %d failed handling %s", self.rank, type(msg).__name__)
                if isinstance(msg, wire.REQUEST_MESSAGES):
                    self._fail(msg.rid, msg.walk if isinstance(msg, wire.WALK_MESSAGES) else "?",
                               f"{type(exc).__name__}: {exc}")
            msg = self.inbox.recv(0.0)
        self.outbox.flush()

    def execute(self) -> None:
        for component, engine in self.engines.items():
            if not engine.has_work():
                continue
            try:
                started = time.perf_counter()
                if self.stall_dump_s:  # off: no context manager on the per-step path
                    with stall_dump(self.stall_dump_s):
                        results = engine.step()
                else:
                    results = engine.step()
                self.stats.record(component, time.perf_counter() - started, engine.last_step_items)
            except Exception as exc:
                logger.exception("engine of %s failed a step", component)
                results = self._fail_engine(component, engine, exc)
            pending = self._pending[component]
            for result in results:
                if result.more:
                    self._loop_value(result)
                    continue  # its item stays in the engine: the pending count stands
                left = pending.get(result.request_id, 0) - 1
                if left > 0:
                    pending[result.request_id] = left
                else:
                    pending.pop(result.request_id, None)
                self._route(result)
            self.outbox.flush()

    # -- receive -------------------------------------------------------------------------------

    def handle(self, msg: Any) -> None:
        if isinstance(msg, wire.REQUEST_MESSAGES) and msg.rid in self._released:
            discard_message(msg, self.codec.discard)  # late traffic of a finished or cancelled request: free its payloads
            return
        if isinstance(msg, wire.StartWalk):
            self._start(msg)
        elif isinstance(msg, wire.RunNode):
            self._remote[(msg.rid, msg.walk, msg.node, msg.iteration)] = msg.reply_to
            self.kv_moves.start(msg.rid, msg.kv_targets)
            inputs = {k: self.codec.unpack(v) for k, v in msg.inputs.items()}
            loop = LoopSpec(msg.loop) if msg.loop else None
            self._submit(msg.rid, msg.walk, msg.node, msg.iteration, inputs, msg.options, loop)
        elif isinstance(msg, wire.NodeDone) and msg.more:
            self._record_loop_value(msg.rid, msg.walk, msg.node, {k: self.codec.unpack(v) for k, v in msg.outputs.items()})
        elif isinstance(msg, wire.NodeDone):
            outcome = Outcome({k: self.codec.unpack(v) for k, v in msg.outputs.items()}, msg.stop, msg.finish_reason)
            self._complete(msg.rid, msg.walk, msg.node, outcome, msg.error)
        elif isinstance(msg, wire.StreamItem):
            if self._buffer(msg.rid, msg.stream).put(msg.seq, self.codec.unpack(msg.value)):
                self._feed_stream(msg.rid, msg.stream)
        elif isinstance(msg, wire.StreamEnd):
            self._buffer(msg.rid, msg.stream).end(msg.total)
            self._feed_stream(msg.rid, msg.stream)
        elif isinstance(msg, wire.ReplicaStep):
            # follower rank of a multi-rank replica: run the lead's batch now (its collectives pair
            # with the lead's); the lead routes the results, ours are dropped
            run_component_step(self.engines[msg.component].module,
                               follower_items(msg, self.codec.unpack, self._to_device))
        elif isinstance(msg, wire.ReplicaEngineStep):
            # follower rank of a tensor-parallel autoregressive replica: the lead's step (replica.py)
            self.engines[msg.component].follow(msg, follower_items(msg, self.codec.unpack, self._to_device))
        elif isinstance(msg, wire.KVOffer | wire.KVAccept | wire.KVLayer | wire.KVEnd):
            self.kv_moves.handle(msg)
        elif isinstance(msg, wire.Release):
            self._release(msg.rid)
        elif isinstance(msg, wire.Shutdown):
            self._running = False

    def _start(self, msg: wire.StartWalk) -> None:
        walk = self._walks[msg.walk]
        state = _Run(msg, walk)
        self._runs[(msg.rid, msg.walk)] = state
        self.kv_moves.start(msg.rid, msg.kv_targets)
        streams = frozenset(s.target_input for s in self.graph.streams if s.target_walk == msg.walk)
        inputs = {k: self._to_device(self.codec.unpack(v)) for k, v in msg.inputs.items()}
        state.outs = self._outs(msg, walk)
        state.run = WalkRun(walk.body, msg.options, inputs, streams, partial(Worker._on_value, self, state),
                            self._engine_loops[msg.walk])
        self._dispatch(state, state.run.start())
        self._finish_if_done(state)

    # -- schedule ------------------------------------------------------------------------------

    def _dispatch(self, state: _Run, calls: list[NodeCall]) -> None:
        rid, walk = state.start.rid, state.start.walk
        for call in calls:
            if call.stream is not None:
                self._blocked[(rid, call.stream[1])] = (walk, call)
                self._feed_stream(rid, call.stream[1])
                continue
            rank = state.start.routes[call.node.name]
            if rank == self.rank:
                self._submit(rid, walk, call.node.name, call.iteration, call.inputs, state.start.options, call.loop)
            else:
                inputs = {k: self.codec.pack(v, rank) for k, v in call.inputs.items()}
                targets = state.start.kv_targets
                msg = wire.RunNode(rid, walk, call.node.name, call.iteration, inputs, state.start.options, self.rank,
                                   call.loop.max_iterations if call.loop else 0,
                                   {c: r for c, r in targets.items() if c == call.node.component} if targets else {})
                self.outbox.send(worker_peer(rank), msg)

    def _submit(self, rid: str, walk: str, node: str, iteration: int, inputs: dict, options: dict,
                loop: LoopSpec | None = None) -> None:
        target = self._target(walk, node)
        if not target.host_inputs:  # engines that read inputs on the host skip the copy
            inputs = {k: self._to_device(v) for k, v in inputs.items()}
        item = StepItem(rid, walk, node, inputs, self._options(rid, target, options), iteration, target.kv_slot, loop)
        pending = target.pending
        pending[rid] = pending.get(rid, 0) + 1
        if not self.kv_moves.submit(target.component, item):
            target.engine.submit(item)

    def _target(self, walk: str, node: str) -> _Target:
        target = self._targets.get((walk, node))
        if target is None:
            spec = self._node_specs[(walk, node)]
            engine = self.engines[spec.component]
            target = self._targets[(walk, node)] = _Target(
                engine, engine.host_inputs, self._namespaces.get(spec.component),
                spec.kv_slot, self._pending[spec.component], spec.component)
        return target

    def _options(self, rid: str, target: _Target, options: dict) -> dict:
        """The request's options as the target's component sees them (scoped once per request)."""
        if not target.namespace:
            return options
        key = (rid, target.namespace)
        scoped = self._scoped.get(key)
        if scoped is None:
            scoped = self._scoped[key] = scoped_options(options, target.namespace)
        return scoped

    def _to_device(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.device == self.device:
            return value
        if self.device.type == "cuda" and value.device.type == "cpu" and value.nbytes <= _PINNED_COPY_BYTES:
            # through pinned memory: a pageable copy would wait for all work queued on the device
            # (e.g. the decode step just launched) before it starts
            return to_device_async(value, self.device)
        return value.to(self.device)

    def _feed_stream(self, rid: str, stream: str) -> None:
        blocked = self._blocked.get((rid, stream))
        if blocked is None:
            return
        chunk = self._buffer(rid, stream).pop()
        if chunk is None:
            return
        walk, call = self._blocked.pop((rid, stream))
        state = self._runs[(rid, walk)]
        if chunk is END:
            if call.per_iteration:  # a loop goes on past its stream: the node runs without the port
                self._dispatch(state, [NodeCall(call.node, call.iteration, dict(call.inputs))])
            else:
                self._complete(rid, walk, call.node.name, Outcome(final_chunk=True), None)
            return
        port = call.stream[0]
        inputs = {**call.inputs, port: chunk.value, f"{port}_new": _scalar(chunk.new),
                  f"{port}_start": _scalar(chunk.start), f"{port}_final": _scalar(chunk.final)}
        if chunk.final:
            self._final_chunks.add((rid, walk, call.node.name))
        self._dispatch(state, [NodeCall(call.node, call.iteration, inputs)])

    def _buffer(self, rid: str, stream: str) -> StreamBuffer:
        buffer = self._buffers.get((rid, stream))
        if buffer is None:
            spec = self._streams[stream]
            buffer = self._buffers[(rid, stream)] = StreamBuffer(spec.policy, spec.accept, spec.dim)
        return buffer

    # -- route ---------------------------------------------------------------------------------

    def _loop_value(self, result: StepResult) -> None:
        """An engine loop's iteration that does not end it: to the driving worker when the loop runs for
        another one, else recorded in its walk."""
        if self._remote:
            key = (result.request_id, result.walk, result.node, result.iteration)
            reply = self._remote.get(key)
            if reply is not None:
                outputs = {k: self.codec.pack(v, reply) for k, v in result.outputs.items()}
                self.outbox.send(worker_peer(reply), wire.NodeDone(*key, outputs, more=True))
                return
        self._record_loop_value(result.request_id, result.walk, result.node, result.outputs)

    def _record_loop_value(self, rid: str, walk: str, node: str, outputs: dict) -> None:
        state = self._runs.get((rid, walk))
        if state is None or state.run is None:
            return  # released or failed meanwhile
        try:
            state.run.loop_value(node, outputs)
        except Exception as exc:  # as in _complete: the walk fails, not the worker
            logger.exception("walk %s of request %s failed", walk, rid)
            self._fail(rid, walk, f"{type(exc).__name__}: {exc}")
            if state.start.routes[node] == self.rank:  # its engine stops the loop now, not at the Release
                target = self._target(walk, node)
                target.engine.release(rid)
                target.pending.pop(rid, None)

    def _route(self, result: StepResult) -> None:
        key = (result.request_id, result.walk, result.node, result.iteration)
        if self._remote and key in self._remote:
            reply = self._remote.pop(key)
            outputs = {k: self.codec.pack(v, reply) for k, v in result.outputs.items()}
            msg = wire.NodeDone(*key, outputs, result.stop, result.error, result.finish_reason)
            self.outbox.send(worker_peer(reply), msg)
            return
        outcome = Outcome(result.outputs, result.stop, result.finish_reason)
        self._complete(result.request_id, result.walk, result.node, outcome, result.error)

    def _complete(self, rid: str, walk: str, node: str, outcome: Outcome, error: str | None) -> None:
        state = self._runs.get((rid, walk))
        if state is None or state.run is None or state.run.waiting(node) is None:
            return  # released meanwhile
        if error is not None:
            self._fail(rid, walk, error)
            return
        if self._final_chunks and (rid, walk, node) in self._final_chunks:
            self._final_chunks.discard((rid, walk, node))
            outcome.final_chunk = True
        try:
            calls = state.run.complete(node, outcome)
        except Exception as exc:
            logger.exception("walk %s of request %s failed", walk, rid)
            self._fail(rid, walk, f"{type(exc).__name__}: {exc}")
            return
        self._dispatch(state, calls)
        if state.run.done:
            self._finish_if_done(state)

    def _outs(self, msg: wire.StartWalk, walk: Walk) -> dict[str, _Out]:
        """Produced edge -> where its values go, for one walk run (looked up once, not per token)."""
        outs = {}
        for edge in {e.edge for e in walk.emits} | set(msg.stream_targets):
            out = _Out(self._client_emits.get((walk.name, edge), ()))
            target = msg.stream_targets.get(edge)
            if target is not None:
                out.rank, out.stream, out.first = target
                if out.rank == self.rank:  # a local stream: items skip the transport
                    out.buffer = self._buffer(msg.rid, out.stream)
            if out.names or out.stream:
                outs[edge] = out
        return outs

    def _on_value(self, state: _Run, edge: str, value: Any) -> None:
        out = state.outs.get(edge)
        if out is None:
            return
        rid = state.start.rid
        for name in out.names:
            self.outbox.send(CONDUCTOR, wire.ClientOutput(rid, name, self.codec.pack(value, None)))
        if not out.stream:
            return
        seq = out.first + out.sent
        out.sent += 1
        buffer = out.buffer
        if buffer is None:
            self.outbox.send(worker_peer(out.rank), wire.StreamItem(rid, out.stream, seq, self.codec.pack(value, out.rank)))
            return
        # a consumer on this worker: into its buffer now, no message, no encoding, same device
        if buffer.put(seq, value):
            self._feed_stream(rid, out.stream)

    def _finish_if_done(self, state: _Run) -> None:
        run = state.run
        key = (state.start.rid, state.start.walk)
        # `_complete` may finish a walk re-entrantly (a stream call answered at once by END): report it once
        if run is None or not run.done or self._runs.get(key) is not state:
            return
        del self._runs[key]
        carries = {
            e.name: self.codec.pack(run.env[e.edge], None) for e in state.walk.emits if e.to == CARRY and e.edge in run.env
        }
        msg = wire.WalkDone(state.start.rid, state.start.walk, carries, state.stream_counts(), run.stopped,
                            run.finish_reason)
        self.outbox.send(CONDUCTOR, msg)

    # -- failure and release -----------------------------------------------------------------------

    def _fail(self, rid: str, walk: str, error: str) -> None:
        self._runs.pop((rid, walk), None)
        self.outbox.send(CONDUCTOR, wire.WalkDone(rid, walk, {}, {}, error=error))

    def _fail_engine(self, component: str, engine: Engine, exc: Exception) -> list[StepResult]:
        """An engine raised outside its own isolation: fail exactly the requests with items in it.

        A request driven here fails its walk; a node run for another worker gets a NodeDone with the
        error, so the driving worker fails that request instead of waiting for it forever.
        """
        error = f"{component} failed: {type(exc).__name__}: {exc}"
        pending = self._pending[component]
        rids = set(pending)
        pending.clear()  # in place: each _Target of the component holds this dict
        for rid in rids:
            engine.release(rid)
            for key in [k for k in self._remote if k[0] == rid]:
                reply = self._remote.pop(key)
                self.outbox.send(worker_peer(reply), wire.NodeDone(*key, {}, False, error, None))
            for run_rid, walk in [k for k in self._runs if k[0] == rid]:
                self._fail(run_rid, walk, error)
        return []

    def _release(self, rid: str) -> None:
        for key in [k for k in self._runs if k[0] == rid]:
            del self._runs[key]
        for pending in self._pending.values():
            pending.pop(rid, None)
        for table in (self._buffers, self._blocked, self._scoped):
            for key in [k for k in table if k[0] == rid]:
                del table[key]
        for key in [k for k in self._remote if k[0] == rid]:
            del self._remote[key]
        self.kv_moves.release(rid)
        self._final_chunks = {k for k in self._final_chunks if k[0] != rid}
        for engine in self.engines.values():
            engine.release(rid)
        self._released.add(rid)
        if len(self._released) > 100_000:
            self._released.clear()

    def state_size(self) -> int:
        """Per-request entries held (for leak tests)."""
        return (len(self._runs) + len(self._remote) + len(self._buffers) + len(self._blocked)
                + len(self._final_chunks) + len(self._scoped) + len(self.kv_moves))
