"""The conductor with fake workers: admission and queueing, replica choice, cancellation, worker death,
and requests that fail between walks (each fails alone and gives its slot back)."""

from __future__ import annotations

import pytest

from mstar.conductor.conductor import AdmissionError, Conductor
from mstar.conductor.request_state import FinishEvent
from mstar.config import NodeGroup
from mstar.graph import ComponentSpec, Emit, Lane, ModelGraph, Node, Walk
from mstar.graph.placement import plan_placement
from mstar.runtime.codecs import LocalCodec
from mstar.transport import wire


def _first(options):
    """The lane's first walk; a wrong-typed option raises as a model's transition might."""
    return "w" if "w" in options.get("modalities", ["w"]) else None


GRAPH = ModelGraph(components={"c": ComponentSpec("stateless", "one node")},
                   walks=(Walk("w", "l", Node("c", inputs=("x",), outputs=("y",)), inputs=("x",), emits=(Emit("y"),)),),
                   lanes=(Lane("l", _first, {"w": None}),))


class FakeWorkers:
    """Records what the conductor sends; `done` answers a started walk as a worker would."""

    def __init__(self, ranks: int = 1, max_concurrent: int = 2, max_queued: int = 2) -> None:
        groups = [NodeGroup(node_names=["c"], ranks=list(range(ranks)))]
        self.sent: list[tuple[int, object]] = []
        self.events: dict[str, list] = {}
        self.conductor = Conductor(GRAPH, plan_placement(GRAPH, groups), lambda rank, msg: self.sent.append((rank, msg)),
                                   LocalCodec(), max_concurrent, max_queued)

    def submit(self, rid: str, **options) -> None:
        self.conductor.submit(rid, {"x": 1}, options, self.events.setdefault(rid, []).append)

    def started(self) -> list[tuple[int, str]]:
        """(rank, wire id) of every StartWalk so far."""
        return [(rank, msg.rid) for rank, msg in self.sent if isinstance(msg, wire.StartWalk)]

    def done(self, wire_id: str, error: str | None = None) -> None:
        self.conductor.handle(wire.WalkDone(wire_id, "w", {}, {}, error=error))

    def finish(self, rid: str) -> FinishEvent:
        (event,) = [e for e in self.events[rid] if isinstance(e, FinishEvent)]
        return event


def test_admits_up_to_the_limit_then_queues_then_refuses():
    fake = FakeWorkers(max_concurrent=2, max_queued=1)
    for rid in "abc":
        fake.submit(rid)
    assert fake.conductor.stats() == {"in_flight": 2, "queued": 1}
    with pytest.raises(AdmissionError, match="server busy") as err:
        fake.submit("d")
    assert err.value.status == 429
    with pytest.raises(AdmissionError, match="already in flight") as err:
        fake.submit("a")
    assert err.value.status == 409
    first = fake.started()[0][1]
    fake.done(first)  # a's walk ends: a finishes and c is admitted
    assert fake.finish("a").finish_reason == "stop" and fake.finish("a").error is None
    assert fake.conductor.stats() == {"in_flight": 2, "queued": 0}
    assert [rid.split("#")[0] for _, rid in fake.started()] == ["a", "b", "c"]


def test_a_request_that_fails_to_start_releases_its_slot_and_answers_itself():
    fake = FakeWorkers(max_concurrent=1, max_queued=4)
    for _ in range(3):  # more than the limit: a leaked slot would queue the next request for good
        fake.submit("bad", modalities=5)  # `"w" in 5` raises TypeError inside the lane's transition
        event = fake.finish("bad")
        assert event.status == 500 and "TypeError" in event.error
        assert fake.conductor.stats() == {"in_flight": 0, "queued": 0}
        fake.events.clear()
    fake.submit("good")
    assert fake.conductor.stats() == {"in_flight": 1, "queued": 0}


def test_a_queued_request_that_fails_on_admission_fails_alone():
    fake = FakeWorkers(max_concurrent=1, max_queued=4)
    fake.submit("a")
    fake.submit("bad", modalities=5)
    fake.submit("c")
    fake.done(fake.started()[0][1])  # a ends; bad is admitted and fails; c is admitted after it
    assert fake.finish("a").error is None
    assert fake.finish("bad").status == 500
    assert [type(e).__name__ for e in fake.events["a"]] == ["FinishEvent"]  # nothing of bad's reaches a
    assert [rid.split("#")[0] for _, rid in fake.started()] == ["a", "c"]
    assert fake.conductor.stats() == {"in_flight": 1, "queued": 0}


def test_a_failed_walk_fails_its_request_and_admits_the_next():
    fake = FakeWorkers(max_concurrent=1, max_queued=1)
    fake.submit("a")
    fake.submit("b")
    fake.done(fake.started()[0][1], error="boom")
    assert (fake.finish("a").error, fake.finish("a").status) == ("boom", 500)
    assert [rid.split("#")[0] for _, rid in fake.started()] == ["a", "b"]
    assert any(isinstance(m, wire.Release) for _, m in fake.sent)  # the worker drops a's state


def test_cancel_removes_queued_and_running_requests():
    fake = FakeWorkers(max_concurrent=1, max_queued=1)
    fake.submit("a")
    fake.submit("b")
    assert fake.conductor.cancel("b") and fake.finish("b").finish_reason == "cancelled"
    assert fake.conductor.cancel("a") and fake.finish("a").finish_reason == "cancelled"
    assert not fake.conductor.cancel("a")  # already gone
    assert fake.conductor.stats() == {"in_flight": 0, "queued": 0}
    fake.submit("a")  # the id is free again and travels under a fresh wire id
    wire_ids = [rid for _, rid in fake.started()]
    assert wire_ids[0] != wire_ids[-1] and wire_ids[-1].startswith("a#")


def test_replicas_are_chosen_by_load_and_a_dead_worker_fails_only_its_requests():
    fake = FakeWorkers(ranks=2, max_concurrent=4, max_queued=0)
    for rid in "abc":
        fake.submit(rid)
    assert [rank for rank, _ in fake.started()] == [0, 1, 0]  # least loaded first
    fake.conductor.worker_died(1, "killed by signal 9")
    assert "worker 1 died: killed by signal 9" in fake.finish("b").error
    assert not any(isinstance(e, FinishEvent) for e in fake.events["a"] + fake.events["c"])
    fake.submit("d")
    assert fake.started()[-1][0] == 0  # never placed on the dead rank again


def test_fail_all_ends_queued_and_running_requests_and_admits_nothing():
    fake = FakeWorkers(max_concurrent=1, max_queued=2)
    for rid in "abc":
        fake.submit(rid)
    assert fake.conductor.fail_all("shutting down") == 3
    assert {rid: (fake.finish(rid).error, fake.finish(rid).status) for rid in "abc"} == {
        rid: ("shutting down", 503) for rid in "abc"}
    assert len(fake.started()) == 1  # the queued ones were never started
    assert fake.conductor.stats() == {"in_flight": 0, "queued": 0}


def test_busy_since_spans_the_running_requests_and_a_held_lock_times_out():
    import threading

    fake = FakeWorkers(max_concurrent=2)
    assert fake.conductor.busy_since(1.0) is None
    fake.submit("a")
    since = fake.conductor.busy_since(1.0)
    fake.submit("b")
    assert fake.conductor.busy_since(1.0) == since  # set by the first, kept while any runs
    for _, wire_id in fake.started():
        fake.done(wire_id)
    assert fake.conductor.busy_since(1.0) is None
    held, release = threading.Event(), threading.Event()

    def hold():
        with fake.conductor._lock:
            held.set()
            release.wait(5)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(5)
    with pytest.raises(TimeoutError, match="held its lock"):
        fake.conductor.busy_since(0.05)
    release.set()
    thread.join()
