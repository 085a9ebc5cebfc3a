"""The conductor: admission, replica choice and next-walk decisions, at walk boundaries only.

It never runs a model and never touches torch.cuda. Messages to workers go through `send`;
worker messages come in through `handle`. Every public method takes the lock, so API threads and
the receiving thread may call it concurrently.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from mstar.conductor.request_state import FinishEvent, OutputEvent, RequestState, Sink
from mstar.graph import ModelGraph, Node, Walk, iter_loops, iter_nodes
from mstar.graph.placement import PlacementPlan
from mstar.transport import wire

logger = logging.getLogger(__name__)


class AdmissionError(RuntimeError):
    """The request was not admitted: 429 with the queue full (retry soon), 503 with no live replica."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


class Conductor:
    """Owns every request's walk state."""

    def __init__(self, graph: ModelGraph, plan: PlacementPlan, send, codec, max_concurrent: int, max_queued: int):
        self.graph, self.plan, self._send, self.codec = graph, plan, send, codec
        self.max_concurrent, self.max_queued = max_concurrent, max_queued
        self._lock = threading.RLock()
        self._active: dict[str, RequestState] = {}  # by wire id
        self._wire_ids: dict[str, str] = {}  # caller's request id -> wire id of its admission
        self._admissions = 0
        self._queue: deque[RequestState] = deque()
        self._load = [0] * plan.num_workers  # active requests touching each rank
        self._dead: dict[int, str] = {}
        self._lanes = {lane.name: lane for lane in graph.lanes}
        self._walks = {w.name: w for w in graph.walks}
        self._worker_stats: dict[int, wire.WorkerStats] = {}  # rank -> latest engine load it reported
        self._busy_since: float | None = None  # monotonic time the first of the running requests was admitted

    # -- API side --------------------------------------------------------------------------

    def submit(self, rid: str, inputs: dict[str, Any], options: dict[str, Any], sink: Sink) -> None:
        """Admit the request, queue it, or raise AdmissionError when the queue is full."""
        with self._lock:
            if rid in self._wire_ids:
                raise AdmissionError(f"request id {rid!r} is already in flight", status=409)
            if len(self._active) >= self.max_concurrent and len(self._queue) >= self.max_queued:
                raise AdmissionError(
                    f"server busy: {len(self._active)} requests in flight and {len(self._queue)} queued "
                    f"(max_queued_requests={self.max_queued}); retry later", status=429)
            # Workers remember released requests to drop their late traffic, so every admission
            # travels under a fresh wire id even when a caller reuses a request id.
            self._admissions += 1
            req = RequestState(f"{rid}#{self._admissions}", inputs, options, _Relabel(sink, rid))
            self._wire_ids[rid] = req.rid
            if len(self._active) < self.max_concurrent:
                self._admit(req)
            else:
                self._queue.append(req)

    def cancel(self, rid: str) -> bool:
        """Remove the request everywhere; True if it was known."""
        with self._lock:
            wire_id = self._wire_ids.get(rid)
            for req in self._queue:
                if req.rid == wire_id:
                    self._queue.remove(req)
                    del self._wire_ids[rid]
                    req.sink(FinishEvent(req.rid, "cancelled", outputs=dict(req.out_seq)))
                    return True
            req = self._active.get(wire_id)
            if req is None:
                return False
            self._end(req, FinishEvent(req.rid, "cancelled", outputs=dict(req.out_seq)))
            return True

    def stats(self) -> dict[str, int]:
        """Requests admitted and running (`in_flight`) and waiting for admission (`queued`)."""
        with self._lock:
            return {"in_flight": len(self._active), "queued": len(self._queue)}

    def busy_since(self, lock_timeout_s: float) -> float | None:
        """When the running requests began to be (monotonic seconds), None when idle; raises TimeoutError
        when the lock is not free within `lock_timeout_s` (a wedged conductor)."""
        if not self._lock.acquire(timeout=lock_timeout_s):
            raise TimeoutError(f"the conductor has held its lock for over {lock_timeout_s:g} s")
        try:
            return self._busy_since
        finally:
            self._lock.release()

    def worker_stats(self) -> dict[int, wire.WorkerStats]:
        """The latest engine load each live worker reported (ranks that never reported are absent)."""
        with self._lock:
            return dict(self._worker_stats)

    # -- worker side -------------------------------------------------------------------------

    def handle(self, msg: Any) -> None:
        with self._lock:
            if isinstance(msg, wire.ClientOutputs):
                for output in msg.outputs:
                    self._client_output(output)
            elif isinstance(msg, wire.ClientOutput):
                self._client_output(msg)
            elif isinstance(msg, wire.WalkDone):
                self._walk_done(msg)
            elif isinstance(msg, wire.WorkerStats) and msg.rank not in self._dead:
                self._worker_stats[msg.rank] = msg

    def _client_output(self, msg: wire.ClientOutput) -> None:
        req = self._active.get(msg.rid)
        if req is None:
            self.codec.discard(msg.value)
            return
        req.sink(OutputEvent(msg.rid, msg.name, req.next_seq(msg.name), self.codec.unpack(msg.value)))

    def worker_died(self, rank: int, reason: str) -> None:
        """Fail every request that touched the rank and place no work there until `worker_revived`."""
        with self._lock:
            self._dead[rank] = reason
            self._worker_stats.pop(rank, None)  # a dead worker's last load would read as live
            # `workers` holds lead ranks only (the conductor sends a replica's other ranks nothing): see replicas.
            for req in [r for r in self._active.values()
                        if rank in r.workers or any(rank in rep for rep in r.sticky.values())]:
                self._end(req, FinishEvent(req.rid, "error", f"worker {rank} died: {reason}", 500,
                                           dict(req.out_seq)))

    def fail_all(self, message: str, status: int = 503) -> int:
        """End every queued and running request with `message` (shutting down); how many there were."""
        with self._lock:
            queued, self._queue = list(self._queue), deque()
            for req in queued:
                self._wire_ids.pop(req.sink.rid, None)
                req.sink(FinishEvent(req.rid, "error", message, status))
            running = list(self._active.values())
            for req in running:
                self._end(req, FinishEvent(req.rid, "error", message, status, dict(req.out_seq)))
            return len(queued) + len(running)

    def worker_revived(self, rank: int) -> None:
        """A restarted worker is ready: place work on the rank again."""
        with self._lock:
            self._dead.pop(rank, None)

    # -- walks ---------------------------------------------------------------------------------

    def _admit(self, req: RequestState) -> None:
        if not self._active:
            self._busy_since = time.monotonic()
        self._active[req.rid] = req
        try:
            firsts = {lane.name: lane.first_walk(req.options) for lane in self.graph.lanes}
            req.active_lanes = {lane for lane, first in firsts.items() if first is not None}
            for stream in self.graph.streams:
                target = self._walks[stream.target_walk]
                if target.lane in req.active_lanes:  # consumers are placed up front: items may come early
                    req.stream_dest[stream.target_input] = self._reserve(req, target)[_first_node(target)]
            for first in firsts.values():
                if first is not None:
                    self._start_walk(req, first)
            if not req.active_lanes:
                self._end(req, FinishEvent(req.rid, "stop"))
        except Exception as exc:  # the request fails alone and gives its slot back
            self._end(req, _failure(req, exc))

    def _start_walk(self, req: RequestState, name: str) -> None:
        walk = self._walks[name]
        routes = req.reserved_routes.pop(name, None) or self._choose_routes(req, walk)
        driver = routes[_first_node(walk)]
        streamed = {s.target_input for s in self.graph.streams if s.target_walk == name}
        inputs = {}
        for edge in walk.inputs + walk.optional_inputs:
            value = req.carries.get(edge, req.inputs.get(edge))
            if value is not None:
                inputs[edge] = self.codec.pack(value, driver)
            elif edge not in streamed and edge not in walk.optional_inputs:
                raise AdmissionError(f"walk {name!r} needs input {edge!r}, which the request does not provide", 400)
        produced = {e for n in iter_nodes(walk.body) for e in n.output_edges}
        targets = {
            s.edge: [req.stream_dest[s.target_input], s.target_input, req.stream_counts.get(s.target_input, 0)]
            for s in self.graph.streams
            if s.source_lane == walk.lane and s.edge in produced and s.target_input in req.stream_dest
        }
        req.current_walk[walk.lane] = name
        self._send(driver, wire.StartWalk(req.rid, name, req.options, inputs, routes, targets,
                                          self._kv_targets(req, walk)))

    def _walk_done(self, msg: wire.WalkDone) -> None:
        req = self._active.get(msg.rid)
        if req is None:
            for value in msg.carries.values():
                self.codec.discard(value)
            return
        if msg.error is not None:
            self._end(req, FinishEvent(req.rid, "error", msg.error, 500, dict(req.out_seq)))
            return
        req.carries.update({k: self.codec.unpack(v) for k, v in msg.carries.items()})
        for stream, count in msg.stream_counts.items():
            req.stream_counts[stream] = req.stream_counts.get(stream, 0) + count
        req.finish_reason = msg.finish_reason or req.finish_reason
        lane = self._lanes[self._walks[msg.walk].lane]
        try:
            nxt = None if msg.stopped else lane.next_walk(msg.walk, req.options)
            if nxt is not None:
                self._start_walk(req, nxt)
                return
            self._lane_done(req, lane.name)
        except Exception as exc:  # as in _admit: this request fails, the others go on
            self._end(req, _failure(req, exc))

    def _lane_done(self, req: RequestState, lane: str) -> None:
        req.active_lanes.discard(lane)
        for s in self.graph.streams:
            if s.source_lane == lane and s.target_input in req.stream_dest:
                total = req.stream_counts.get(s.target_input, 0)
                self._send(req.stream_dest[s.target_input], wire.StreamEnd(req.rid, s.target_input, total))
        if not req.active_lanes:
            self._end(req, FinishEvent(req.rid, req.finish_reason or "stop", outputs=dict(req.out_seq)))

    def _end(self, req: RequestState, event: FinishEvent) -> None:
        """Finish, fail or cancel: release the request on every worker, tell the caller, admit more."""
        if self._active.pop(req.rid, None) is None:
            return
        if not self._active:
            self._busy_since = None
        self._wire_ids.pop(req.sink.rid, None)
        for rank in req.workers:
            self._load[rank] -= 1
            if rank not in self._dead:
                self._send(rank, wire.Release(req.rid))
        event.streams = dict(req.stream_counts)
        req.sink(event)
        while self._queue and len(self._active) < self.max_concurrent:
            self._admit(self._queue.popleft())

    # -- placement -------------------------------------------------------------------------------

    def _reserve(self, req: RequestState, walk: Walk) -> dict[str, int]:
        if walk.name not in req.reserved_routes:
            req.reserved_routes[walk.name] = self._choose_routes(req, walk)
        return req.reserved_routes[walk.name]

    def _choose_routes(self, req: RequestState, walk: Walk) -> dict[str, int]:
        """Node -> rank: the request's earlier replica for the component if it serves this walk,
        else the least-loaded live replica."""
        routes = {}
        for node in iter_nodes(walk.body):
            replicas = self.plan.node_replicas(node.component, node.name, walk.name)
            candidates = [r for r in replicas if not self._dead.keys() & set(r)]
            if not candidates:
                raise AdmissionError(
                    f"no live worker runs component {node.component!r} for walk {walk.name!r} "
                    f"(dead: {self._dead})", status=503)
            replica = req.sticky.get(node.component)
            if replica not in candidates:
                replica = min(candidates, key=lambda r: self._load[r[0]])
                req.sticky[node.component] = replica
            routes[node.name] = replica[0]
            if replica[0] not in req.workers:
                req.workers.add(replica[0])
                self._load[replica[0]] += 1
        return routes

    def _kv_targets(self, req: RequestState, walk: Walk) -> dict[str, int]:
        """Component -> rank, for each autoregressive component of `walk` whose sequence the lane's next walk
        continues on another replica: that walk's routes are chosen now, so the sequence's K/V can stream
        there while `walk` computes them. Only one-rank replicas move a sequence (a tensor-parallel
        replica's shards recompute it), and only one that `walk` gives a single item (`_single_items`)."""
        nxt = self._lanes[walk.lane].next_walk(walk.name, req.options)
        if nxt is None:
            return {}
        here = {n.component: req.sticky[n.component] for n in _single_items(self.graph, walk)}
        moving = [n for n in iter_nodes(self._walks[nxt].body) if len(here.get(n.component, ())) == 1
                  and here[n.component] not in self.plan.node_replicas(n.component, n.name, nxt)]
        if not moving:
            return {}
        routes = self._reserve(req, self._walks[nxt])
        return {n.component: routes[n.name] for n in moving if len(req.sticky[n.component]) == 1}


def _failure(req: RequestState, exc: Exception) -> FinishEvent:
    """The event that fails `req` for `exc`: an AdmissionError's own status, else a logged 500."""
    if isinstance(exc, AdmissionError):
        return FinishEvent(req.rid, "error", str(exc), exc.status, dict(req.out_seq))
    logger.exception("request %s failed between walks", req.rid)
    return FinishEvent(req.rid, "error", f"internal error: {type(exc).__name__}: {exc}", 500, dict(req.out_seq))


def _single_items(graph: ModelGraph, walk: Walk) -> list[Node]:
    """The autoregressive nodes of `walk` that are their component's one item in it: its only node, outside
    any loop the walk runs iteration by iteration. The sender forgets a streamed sequence when its item
    ends, so a component given more items stays where it is (its sequence is recomputed where it goes)."""
    stepped = {id(n) for loop in iter_loops(walk.body) if graph.engine_loop(walk, loop) is None
               for n in iter_nodes(loop.body)}
    nodes = [n for n in iter_nodes(walk.body) if graph.components[n.component].engine == "autoregressive"]
    return [n for n in nodes if id(n) not in stepped and sum(m.component == n.component for m in nodes) == 1]


def _first_node(walk: Walk) -> str:
    return next(iter_nodes(walk.body)).name


class _Relabel:
    """Delivers events to the caller's sink under the caller's request id."""

    def __init__(self, sink: Sink, rid: str) -> None:
        self.sink, self.rid = sink, rid

    def __call__(self, event: OutputEvent | FinishEvent) -> None:
        event.rid = self.rid
        self.sink(event)
