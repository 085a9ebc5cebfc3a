"""The conductor's policy with fake workers, walk by walk, on a three-walk lane whose components sit on
different ranks: queue order and refusal, least-loaded and sticky replica choice, cancellation released
on every worker a request touched, and worker death failing exactly the requests on that rank while the
rest and the queue go on. Complements test_conductor.py."""

from __future__ import annotations

from collections import defaultdict

import pytest

from mstar.conductor.conductor import AdmissionError, Conductor
from mstar.conductor.request_state import FinishEvent, OutputEvent
from mstar.config import NodeGroup
from mstar.graph import ComponentSpec, Emit, Lane, ModelGraph, Node, Walk
from mstar.graph.placement import plan_placement
from mstar.transport import wire


def _walk(name: str, component: str) -> Walk:
    return Walk(name, "l", Node(component, inputs=("x",), outputs=("y",)), inputs=("x",), emits=(Emit("y"),))


def _graph(tensor_parallel: bool = False) -> ModelGraph:
    """encode (on `enc`) -> prefill -> decode (both on `dec`)."""
    dec = ComponentSpec("autoregressive", "decoder", tensor_parallel=tensor_parallel)
    return ModelGraph(components={"enc": ComponentSpec("stateless", "encoder"), "dec": dec},
                      walks=(_walk("encode", "enc"), _walk("prefill", "dec"), _walk("decode", "dec")),
                      lanes=(Lane("l", "encode", {"encode": "prefill", "prefill": "decode", "decode": None}),))


# enc on rank 0; dec replicated on ranks 1 and 2
SPLIT = [NodeGroup(node_names=["enc"], ranks=[0]), NodeGroup(node_names=["dec"], ranks=[1, 2])]


class RecordingCodec:
    """Values travel as themselves; discarded ones (late traffic of ended requests) are recorded."""

    def __init__(self) -> None:
        self.discarded: list[object] = []

    def pack(self, value: object, to: int | None) -> object:
        return value

    def unpack(self, value: object) -> object:
        return value

    def discard(self, value: object) -> None:
        self.discarded.append(value)


class FakeWorkers:
    """Records what the conductor sends to each rank and answers as the driver worker of a walk would."""

    def __init__(self, groups=SPLIT, max_concurrent: int = 8, max_queued: int = 8, tensor_parallel: bool = False):
        graph = _graph(tensor_parallel)
        self.sent: list[tuple[int, object]] = []
        self.events: dict[str, list] = defaultdict(list)
        self.codec = RecordingCodec()
        self.conductor = Conductor(graph, plan_placement(graph, groups), lambda rank, msg: self.sent.append((rank, msg)),
                                   self.codec, max_concurrent, max_queued)

    def submit(self, *rids: str) -> None:
        for rid in rids:
            self.conductor.submit(rid, {"x": 1}, {}, self.events[rid].append)

    def starts(self, rid: str | None = None) -> list[tuple[str, str, int]]:
        """(request, walk, rank) of every StartWalk, in order; only `rid`'s when given."""
        return [(m.rid.split("#")[0], m.walk, rank) for rank, m in self.sent
                if isinstance(m, wire.StartWalk) and rid in (None, m.rid.split("#")[0])]

    def wire_id(self, rid: str) -> str:
        return next(m.rid for _, m in reversed(self.sent) if isinstance(m, wire.StartWalk) and m.rid.startswith(f"{rid}#"))

    def walk_done(self, rid: str, walk: str, **fields) -> None:
        self.conductor.handle(wire.WalkDone(self.wire_id(rid), walk, {}, {}, **fields))

    def run_to_end(self, rid: str) -> None:
        """The request's remaining walks all finish."""
        while self.finish(rid) is None:
            self.walk_done(rid, self.starts(rid)[-1][1])

    def releases(self) -> list[tuple[str, int]]:
        """(request, rank) of every Release, in order."""
        return [(m.rid.split("#")[0], rank) for rank, m in self.sent if isinstance(m, wire.Release)]

    def finish(self, rid: str) -> FinishEvent | None:
        ends = [e for e in self.events[rid] if isinstance(e, FinishEvent)]
        assert len(ends) <= 1, f"{rid} finished {len(ends)} times"
        return ends[0] if ends else None


def test_the_queue_admits_in_arrival_order_and_a_refused_id_may_retry():
    fake = FakeWorkers(max_concurrent=2, max_queued=2)
    fake.submit("a", "b", "c", "d")
    with pytest.raises(AdmissionError, match="max_queued_requests=2") as refused:
        fake.submit("e")
    assert refused.value.status == 429 and fake.finish("e") is None
    assert fake.conductor.stats() == {"in_flight": 2, "queued": 2}
    fake.run_to_end("b")
    assert fake.finish("b").finish_reason == "stop"
    assert fake.conductor.cancel("d")  # cancelled while queued: it never started, no worker holds it
    assert fake.finish("d").finish_reason == "cancelled" and fake.starts("d") == []
    assert ("d", 0) not in fake.releases() and fake.conductor.stats() == {"in_flight": 2, "queued": 0}
    fake.submit("e")  # the client comes back with the same id after its 429, and waits its turn
    assert fake.conductor.stats() == {"in_flight": 2, "queued": 1}
    fake.run_to_end("a")
    assert [rid for rid, walk, _ in fake.starts() if walk == "encode"] == ["a", "b", "c", "e"]


def test_each_component_goes_to_its_least_loaded_replica_and_a_request_stays_on_its_replica():
    fake = FakeWorkers()
    fake.submit("a", "b", "c")
    assert {rank for _, _, rank in fake.starts()} == {0}  # enc has one replica
    for rid in "abc":
        fake.walk_done(rid, "encode")
    # ties go to the first listed replica; load is the requests touching a rank
    assert [(rid, rank) for rid, walk, rank in fake.starts() if walk == "prefill"] == [("a", 1), ("b", 2), ("c", 1)]
    fake.walk_done("a", "prefill")
    assert fake.starts("a")[-1] == ("a", "decode", 1)  # rank 1 carries two requests, but a's KV is there
    for rid in "ac":  # rank 1 is idle again; rank 2 still carries b
        fake.run_to_end(rid)
    fake.submit("d")
    fake.walk_done("d", "encode")
    assert fake.starts("d")[-1] == ("d", "prefill", 1)


def test_cancelling_a_running_request_releases_it_on_every_worker_it_touched_and_drops_its_late_traffic():
    fake = FakeWorkers(max_concurrent=1, max_queued=1)
    fake.submit("a", "b")
    fake.walk_done("a", "encode")
    a_wire = fake.wire_id("a")
    fake.conductor.handle(wire.ClientOutputs([wire.ClientOutput(a_wire, "y", "first"), wire.ClientOutput(a_wire, "y", "second")]))
    assert fake.conductor.cancel("a")
    assert (fake.finish("a").finish_reason, fake.finish("a").outputs) == ("cancelled", {"y": 2})
    assert sorted(fake.releases()) == [("a", 0), ("a", 1)]  # the encoder's rank and the decoder's, not rank 2
    assert fake.starts("b") == [("b", "encode", 0)]  # the freed slot admits the queued request
    fake.conductor.handle(wire.ClientOutput(a_wire, "y", "late"))
    fake.conductor.handle(wire.WalkDone(a_wire, "prefill", {"kv": "late carry"}, {}))
    assert [(e.rid, e.seq, e.value) for e in fake.events["a"] if isinstance(e, OutputEvent)] == [
        ("a", 0, "first"), ("a", 1, "second")]
    assert fake.codec.discarded == ["late", "late carry"]
    assert not fake.conductor.cancel("a") and fake.starts("a")[-1][1] == "prefill"  # no decode started


def test_a_dead_worker_fails_exactly_its_requests_and_placement_avoids_it_until_revived():
    fake = FakeWorkers(max_concurrent=3, max_queued=1)
    fake.submit("a", "b", "c", "d")  # d queued
    fake.walk_done("a", "encode")  # a's decoder on rank 1
    fake.walk_done("b", "encode")  # b's on rank 2; c is still encoding on rank 0
    fake.conductor.handle(wire.WorkerStats(1, []))
    fake.conductor.worker_died(1, "killed by signal 9")
    a_end = fake.finish("a")
    assert (a_end.finish_reason, a_end.status, a_end.error) == ("error", 500, "worker 1 died: killed by signal 9")
    assert fake.releases() == [("a", 0)]  # nothing is sent to the dead rank
    assert [rid for rid in "bcd" if fake.finish(rid)] == [] and fake.starts("d") == [("d", "encode", 0)]
    assert 1 not in fake.conductor.worker_stats()
    fake.conductor.handle(wire.WorkerStats(1, []))  # a last report still in flight from the dead worker
    assert 1 not in fake.conductor.worker_stats()
    fake.walk_done("c", "encode")
    assert fake.starts("c")[-1] == ("c", "prefill", 2)  # rank 2 carries b, but rank 1 is dead
    for rid in "bc":
        fake.run_to_end(rid)
        assert fake.finish(rid).finish_reason == "stop" and fake.finish(rid).error is None
    fake.conductor.worker_revived(1)
    fake.walk_done("d", "encode")
    assert fake.starts("d")[-1] == ("d", "prefill", 1)


def test_with_no_live_replica_requests_fail_with_503_one_by_one_and_the_queue_drains():
    fake = FakeWorkers(max_concurrent=1, max_queued=2)
    fake.submit("a", "b", "c")
    fake.conductor.worker_died(0, "exit code 1")  # the only encoder
    assert fake.finish("a").status == 500
    for rid in "bc":  # admitted in turn, each fails alone and hands its slot on
        end = fake.finish(rid)
        assert (end.status, end.finish_reason) == (503, "error")
        assert "no live worker runs component 'enc' for walk 'encode'" in end.error
    assert fake.conductor.stats() == {"in_flight": 0, "queued": 0}
    assert fake.starts() == [("a", "encode", 0)]
    fake.conductor.worker_revived(0)
    fake.submit("d")
    assert fake.starts("d") == [("d", "encode", 0)]


def test_a_request_whose_next_walk_has_no_live_replica_fails_between_walks_and_is_released():
    fake = FakeWorkers()
    fake.submit("a")
    fake.conductor.worker_died(1, "exit code 1")
    fake.conductor.worker_died(2, "exit code 1")
    assert fake.finish("a") is None  # it has not reached the decoder yet
    fake.walk_done("a", "encode")
    assert (fake.finish("a").status, "no live worker runs component 'dec'" in fake.finish("a").error) == (503, True)
    assert fake.releases() == [("a", 0)] and fake.conductor.stats() == {"in_flight": 0, "queued": 0}


def test_a_dead_rank_of_a_tensor_parallel_replica_fails_the_requests_on_that_replica():
    groups = [NodeGroup(node_names=["enc"], ranks=[0]), NodeGroup(node_names=["dec"], ranks=[1, 2, 3, 4], tp_size=2)]
    fake = FakeWorkers(groups, tensor_parallel=True)
    fake.submit("a", "b")
    for rid in "ab":
        fake.walk_done(rid, "encode")
    assert [(rid, rank) for rid, walk, rank in fake.starts() if walk == "prefill"] == [("a", 1), ("b", 3)]
    fake.conductor.worker_died(2, "killed by signal 9")  # not the lead rank of a's replica (1, 2)
    assert fake.finish("a") is not None and "worker 2 died" in fake.finish("a").error
    assert fake.finish("b") is None
    assert sorted(fake.releases()) == [("a", 0), ("a", 1)]  # the lead rank tells the rest of its replica
