"""The worker's engine loops against the generic route: the same workload, pumped step by step from one
thread (conductor and workers), gives the same client events in the same order, the same iterations
run by the engines (inputs, options), the same per-request pending counts after every round, the same
stops, lengths, failures and cancellations, and leaves no state behind. The generic reference is the
same graph with the decode loop's node wrapped in a Sequential, which makes it no engine loop.

A fake autoregressive-like `llm` answers a varying number of its pending items per step, so requests
interleave differently from round to round (an engine loop's item goes to the back of the queue after
each iteration, as the generic route's next item would); a stateless `snac` reads the `llm` tokens
through a sliding-window stream (on the same worker or another one) and a stream filter that drops some.
"""

from __future__ import annotations

import pytest
import torch

from mstar.conductor.conductor import Conductor
from mstar.conductor.request_state import FinishEvent
from mstar.config import NodeGroup
from mstar.engines.base import StatelessBase, StatelessSpec, StepItem, StepResult
from mstar.engines.stateless import StatelessEngine
from mstar.graph import (
    CARRY,
    ComponentSpec,
    Emit,
    Lane,
    Loop,
    ModelGraph,
    Node,
    Sequential,
    SlidingWindow,
    StreamEdge,
    Walk,
)
from mstar.graph.placement import plan_placement
from mstar.runtime.codecs import LocalCodec
from mstar.transport import wire
from mstar.transport.channels import make_network
from mstar.transport.messages import Codec
from mstar.worker.worker import CONDUCTOR, Worker, worker_peer

BAD_TOKEN = 666  # the stream filter raises on it: the request fails inside the walk's value routing


def _keep(item: torch.Tensor, kept: int) -> bool:
    token = int(item.reshape(-1)[0])
    if token == BAD_TOKEN:
        raise ValueError(f"token {token} cannot be vocoded")
    return token % 5 != 0


def _graph(prep: bool = False, accumulate: bool = False, engine_loop: bool = True) -> ModelGraph:
    """Orpheus-shaped: prefill -> decode Loop(llm) (tokens to the client and into the vocoder stream);
    without `engine_loop` the loop's body is Sequential(llm), which the interpreter runs iteration by
    iteration.
    `prep`: a stateless node runs before the loop in the decode walk, so the walk's driver is the
    prep's worker and the loop node may run on another one. `accumulate`: the loop also gathers its
    tokens, sent to the client once, joined, when it ends."""
    prefill = Node("llm", inputs={"input_ids": "prompt_ids"}, outputs={"token": "token"})
    decode = Node("llm", inputs={"input_ids": "token", "prompt_ids": "prompt_ids"},
                  outputs={"token": "token", "copy": "generated"} if accumulate else {"token": "token"})
    loop = Loop(decode if engine_loop else Sequential(decode), max_iterations="max_tokens", name="decode",
                accumulate=("generated",) if accumulate else ())
    body = Sequential(Node("prep", inputs=("token",), outputs=("token",)), loop) if prep else loop
    emits = (Emit("token", name="text"),) + ((Emit("generated"),) if accumulate else ())
    components = {"llm": ComponentSpec("autoregressive", "fake: next token"),
                  "snac": ComponentSpec("stateless", "fake: windows of tokens -> samples")}
    if prep:
        components["prep"] = ComponentSpec("stateless", "passes the token on")
    return ModelGraph(
        components=components,
        walks=(Walk("prefill", "lm", prefill, inputs=("prompt_ids",),
                    emits=(Emit("token", name="text"), Emit("token", CARRY))),
               Walk("decode", "lm", body, inputs=("token", "prompt_ids"), emits=emits),
               Walk("vocode", "vocoder", Node("snac", inputs=("codes",), outputs=("audio",)), inputs=("codes",),
                    emits=(Emit("audio"),))),
        lanes=(Lane("lm", "prefill", {"prefill": "decode", "decode": None}),
               Lane("vocoder", "vocode", {"vocode": None})),
        streams=(StreamEdge("token", "lm", "vocode", "codes", SlidingWindow(4, 2, recut_at_end=True, first=3),
                            accept=_keep),),
    )


class FakeLM:
    """Answers the oldest 1, 3, 2, 5, 4, 1, ... pending iterations per step; logs every iteration it runs.

    Token = f(request, inputs); options `stop_at` (generated count: stop there, reason "stop"),
    `fail_at` (an error result), `bad_at` (BAD_TOKEN, which the stream filter rejects). An engine-loop
    item feeds its token back as its next `input_ids` (its other inputs kept) and goes to the back of
    the queue, until it stops, fails or runs its last iteration."""

    host_inputs = True
    PATTERN = (1, 3, 2, 5, 4)

    def __init__(self) -> None:
        self.pending: list[tuple[StepItem, int, dict]] = []  # (item, iteration, its inputs)
        self.ran: list[tuple] = []
        self.made: dict[str, int] = {}
        self.steps = 0
        self.last_step_items = 0

    def submit(self, item: StepItem) -> None:
        self.pending.append((item, item.iteration, item.inputs))

    def has_work(self) -> bool:
        return bool(self.pending)

    def release(self, request_id: str) -> None:
        self.pending = [p for p in self.pending if p[0].request_id != request_id]

    def step(self) -> list[StepResult]:
        n = self.PATTERN[self.steps % len(self.PATTERN)]
        self.steps += 1
        ready, self.pending = self.pending[:n], self.pending[n:]
        self.last_step_items = len(ready)
        return [self._answer(*p) for p in ready]

    def _answer(self, item: StepItem, iteration: int, inputs: dict) -> StepResult:
        rid, opts = item.request_id, item.options
        self.ran.append((rid, item.walk, item.node, iteration, item.kv_slot, {k: v.tolist() for k, v in inputs.items()},
                         sorted(opts.items())))
        made = self.made[rid] = self.made.get(rid, 0) + 1
        if made == opts.get("fail_at"):
            return StepResult(rid, item.walk, item.node, error="fake llm failed", iteration=item.iteration)
        ids = inputs["input_ids"]
        token = BAD_TOKEN if made == opts.get("bad_at") else (int(ids.sum()) * 7 + len(rid) + made) % 97 + 1
        stop = made == opts.get("stop_at")
        out = torch.tensor([token])
        outputs = {"token": out, "copy": out} if item.node == "llm" else {"token": out}
        more = item.loop is not None and not stop and iteration + 1 < item.loop.max_iterations
        if more:
            self.pending.append((item, iteration + 1, {**inputs, "input_ids": out}))
        return StepResult(rid, item.walk, item.node, outputs, stop=stop, iteration=item.iteration,
                          finish_reason="stop" if stop else None, more=more)


class FakeSnac(StatelessBase, torch.nn.Module):
    def run_batch(self, walk, node, inputs, options):
        return [{"audio": x["codes"].float() * 2 + x["codes_new"].float()} for x in inputs]


class Prep(StatelessBase, torch.nn.Module):
    def run_batch(self, walk, node, inputs, options):
        return [{"token": x["token"].clone()} for x in inputs]


def _engines(components: list[str]) -> dict:
    made = {"llm": FakeLM, "snac": lambda: StatelessEngine(FakeSnac(), StatelessSpec(max_batch_size=3)),
            "prep": lambda: StatelessEngine(Prep())}
    return {c: made[c]() for c in components}


class Harness:
    """Conductor and workers in one thread; every event, submitted item and pending count recorded."""

    def __init__(self, graph: ModelGraph, groups: list[NodeGroup], max_concurrent: int = 8) -> None:
        plan = plan_placement(graph, groups)
        network = make_network("inproc", Codec(wire.Message))
        self.inbox, outbox, codec = network.inbox(CONDUCTOR), network.outbox(), LocalCodec()
        self.conductor = Conductor(graph, plan, lambda rank, msg: outbox.send(worker_peer(rank), msg), codec,
                                   max_concurrent, 64)
        self.workers = [Worker(r, graph, _engines(plan.components_on(r)), network.inbox(worker_peer(r)),
                               network.outbox(), codec, torch.device("cpu"))
                        for r in range(plan.num_workers)]
        self.events: list[tuple] = []  # every request's events, in the order the sinks saw them
        self.finished: set[str] = set()
        self.pending_log: list[list[dict]] = []
        self.messages: dict[str, int] = {}  # message type -> how many the conductor received

    def submit(self, rid: str, prompt: list[int], **options) -> None:
        self.conductor.submit(rid, {"prompt_ids": torch.tensor(prompt)}, {"max_tokens": 12, **options},
                              self._sink)

    def _sink(self, event) -> None:
        if isinstance(event, FinishEvent):
            self.finished.add(event.rid)
            self.events.append((event.rid, "finish", event.finish_reason, event.error, sorted(event.outputs.items())))
        else:
            self.events.append((event.rid, event.name, event.seq, event.value.tolist()))

    def pump(self, rounds: int = 1) -> None:
        for _ in range(rounds):
            for worker in self.workers:
                worker.receive(0.0)
                worker.execute()
            while (msg := self.inbox.recv(0.0)) is not None:
                self.messages[type(msg).__name__] = self.messages.get(type(msg).__name__, 0) + 1
                self.conductor.handle(msg)
            self.pending_log.append([{c: dict(p) for c, p in w._pending.items()} for w in self.workers])

    def run(self, rids: list[str], cancel: dict[str, int] | None = None, limit: int = 2000) -> None:
        cancel = dict(cancel or {})
        for n in range(limit):
            if set(rids) <= self.finished:
                break
            for rid, at in list(cancel.items()):
                if n == at:
                    assert self.conductor.cancel(rid)
                    del cancel[rid]
            self.pump()
        else:
            raise AssertionError(f"requests {set(rids) - self.finished} did not finish in {limit} rounds")
        self.pump(3)  # the workers take their Release messages

    def record(self) -> dict:
        return {"events": self.events, "pending": self.pending_log, "messages": self.messages,
                "ran": [e.ran for w in self.workers for e in w.engines.values() if isinstance(e, FakeLM)],
                "state": [w.state_size() for w in self.workers],
                "left": [{c: dict(p) for c, p in w._pending.items()} for w in self.workers]}


WORKLOAD = [  # rid, prompt, options
    ("plain", [1, 2, 3], {}),
    ("stops", [4, 5], {"stop_at": 6}),
    ("fails", [6], {"fail_at": 5}),
    ("bad", [7, 8, 9], {"bad_at": 4}),
    ("long", [2, 2], {"max_tokens": 30}),
    ("zero", [3], {"max_tokens": 0}),  # the decode loop runs zero times
    ("one", [5, 1], {"max_tokens": 1}),  # one decode iteration: the engine loop's first is its last
    ("stop_last", [9], {"max_tokens": 5, "stop_at": 6}),  # a stop on the last iteration: "stop", not "length"
    ("cancelled", [8, 8], {"max_tokens": 40}),
]
PLACEMENTS = {
    "one_worker": [NodeGroup(["llm", "snac"], [0])],
    "stream_to_other_worker": [NodeGroup(["llm"], [0]), NodeGroup(["snac"], [1])],
}


def _run(engine_loop: bool, groups: list[NodeGroup], max_concurrent: int = 8, **graph) -> dict:
    h = Harness(_graph(engine_loop=engine_loop, **graph), groups, max_concurrent)
    for rid, prompt, options in WORKLOAD:
        h.submit(rid, prompt, **options)
    h.run([rid for rid, _, _ in WORKLOAD], cancel={"cancelled": 9})
    return h.record()


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("accumulate", [False, True])
def test_engine_loops_match_the_generic_route(placement, accumulate):
    fast = _run(True, PLACEMENTS[placement], accumulate=accumulate)
    generic = _run(False, PLACEMENTS[placement], accumulate=accumulate)
    assert fast["events"] == generic["events"]
    assert fast["ran"] == generic["ran"]
    assert fast["pending"] == generic["pending"]
    assert fast["messages"] == generic["messages"]
    batches = fast["messages"].get("ClientOutputs", 0) + fast["messages"].get("ClientOutput", 0)
    assert fast["messages"]["ClientOutputs"] > 0 and batches < sum(e[1] != "finish" for e in fast["events"])
    assert fast["state"] == generic["state"] == [0] * len(fast["state"])
    assert all(not p for w in fast["left"] for p in w.values())
    finish = {e[0]: e[2:4] for e in fast["events"] if e[1] == "finish"}
    assert finish["plain"] == ("length", None) and finish["long"] == ("length", None)
    assert finish["zero"] == ("stop", None) and finish["one"] == ("length", None)
    assert finish["stops"] == ("stop", None) and finish["stop_last"] == ("stop", None)
    assert finish["fails"][0] == "error" and "fake llm failed" in finish["fails"][1]
    assert finish["bad"][0] == "error" and "cannot be vocoded" in finish["bad"][1]
    assert finish["cancelled"] == ("cancelled", None)
    texts = {}
    for event in fast["events"]:
        if event[1] == "text":
            texts.setdefault(event[0], []).append(event[2])
    assert all(seqs == list(range(len(seqs))) for seqs in texts.values())  # in order, none lost
    lengths = {rid: len(seqs) for rid, seqs in texts.items()}  # prefill's token + the loop's
    assert lengths["plain"] == 13 and lengths["long"] == 31 and lengths["zero"] == 1 and lengths["one"] == 2
    assert lengths["stops"] == 6 and lengths["stop_last"] == 6
    assert any(e[1] == "audio" for e in fast["events"])
    if accumulate:  # once per finished loop: its tokens, joined
        joined = {e[0]: e[3] for e in fast["events"] if e[1] == "generated"}
        tokens = {}
        for event in fast["events"]:
            if event[1] == "text" and event[2] > 0:
                tokens.setdefault(event[0], []).extend(event[3])
        assert joined and all(joined[rid] == tokens[rid] for rid in joined)


def test_an_engine_loop_on_another_worker_reports_each_iteration_to_the_driver():
    """The decode walk's driver (its `prep` node's worker) sends the loop to the llm's worker once
    (one RunNode); each iteration comes back as a NodeDone with `more`, the last without: each request
    gets the same events and runs the same iterations as on the generic route, which sends a RunNode
    per iteration. (Not in the same global order: the llm's worker runs the loop of the request that
    fails on the driver until its Release arrives, which shifts the others' turns in the fake llm.)"""
    groups = [NodeGroup(["prep", "snac"], [0]), NodeGroup(["llm"], [1])]
    sent: dict[str, int] = {}
    original = Worker.handle

    def counting(self, msg):
        sent[type(msg).__name__] = sent.get(type(msg).__name__, 0) + 1
        return original(self, msg)

    Worker.handle = counting
    try:
        fast = _run(True, groups, prep=True)
        fast_sent, sent = sent, {}
        generic = _run(False, groups, prep=True)
    finally:
        Worker.handle = original
    def per_request(rows: list[tuple]) -> dict[str, list]:
        out: dict[str, list] = {}
        for row in rows:
            out.setdefault(row[0], []).append(row)
        return out

    assert per_request(fast["events"]) == per_request(generic["events"])
    ran, ran_generic = per_request(fast["ran"][0]), per_request(generic["ran"][0])
    bad = next(rid for rid in ran if rid.startswith("bad"))
    assert ran_generic[bad] == ran[bad][: len(ran_generic[bad])]  # then more, until its Release
    assert {r: v for r, v in ran.items() if r != bad} == {r: v for r, v in ran_generic.items() if r != bad}
    assert fast["state"] == generic["state"] == [0, 0]
    texts = [e for e in fast["events"] if e[0] == "plain" and e[1] == "text"]
    assert len(texts) == 14  # prefill, prep (it writes the token edge too), 12 iterations
    loops = sum(1 for r in WORKLOAD if r[2].get("max_tokens", 12) > 0)
    assert fast_sent["RunNode"] <= loops < sent["RunNode"]
    assert fast_sent["NodeDone"] > loops


def test_engine_loops_take_the_decode_steps_and_queued_requests_wait_the_same():
    """With fewer slots than requests, later requests are admitted as earlier ones end: the same
    admissions and events; and the engine ran the decode iterations (the generic route's `_complete`
    ran once per loop, not once per iteration)."""
    calls = {}
    original = Worker._complete

    def counting(self, *args, **kwargs):
        calls[mode] = calls.get(mode, 0) + 1
        return original(self, *args, **kwargs)

    Worker._complete = counting
    try:
        mode = "engine"
        fast = _run(True, PLACEMENTS["one_worker"], 3)
        mode = "generic"
        generic = _run(False, PLACEMENTS["one_worker"], 3)
    finally:
        Worker._complete = original
    assert fast["events"] == generic["events"] and fast["ran"] == generic["ran"]
    assert fast["pending"] == generic["pending"]
    decode_iterations = sum(1 for item in fast["ran"][0] if item[1] == "decode")
    assert calls["generic"] - calls["engine"] >= decode_iterations - 2 * len(WORKLOAD)
