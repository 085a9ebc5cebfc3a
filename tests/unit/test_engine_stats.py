"""Engine stats end to end without a server: engines' stats(), the worker's StatsReporter, the
conductor's latest-per-worker table and the Prometheus collector reading it."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from mstar.engines.base import StatelessBase, StatelessSpec, StepItem
from mstar.engines.stateless import StatelessEngine
from mstar.server.metrics import ServerMetrics, output_modality
from mstar.transport import wire
from mstar.worker.stats import StatsReporter
from tests.unit.test_ar_engine import TinyLM, item, make_engine


@pytest.fixture(scope="module")
def model():
    return TinyLM()


def test_autoregressive_stats_follow_pages_sequences_and_release(model):
    engine = make_engine(model, pages=16, page_size=4)
    engine.submit(item("a", list(range(1, 10))))  # 9 tokens: 3 pages once computed
    engine.submit(item("b", [5, 6]))
    assert engine.stats() == {"queue_depth": 2, "kv_pages_used": 0, "kv_pages_cached": 0, "kv_pages_total": 16,
                              "seqs_running": 0, "seqs_waiting": 2, "preemptions": 0, "prompt_tokens": 0,
                              "kv_pages_sent": 0, "kv_pages_received": 0, "kv_pages_reused": 0}
    results = engine.step()
    assert engine.last_step_items == 2 and len(results) == 2
    stats = engine.stats()
    assert stats["prompt_tokens"] == 9 + 2
    assert stats["kv_pages_used"] == 3 + 1 and stats["seqs_running"] == 2 and stats["queue_depth"] == 0
    engine.release("a")
    engine.release("b")
    stats = engine.stats()
    assert stats["kv_pages_used"] == 0 and stats["seqs_running"] == 0
    assert stats["kv_pages_cached"] == 2  # a's two full pages stay for prefix reuse, evictable


def test_autoregressive_stats_count_preemptions(model):
    engine = make_engine(model, pages=4, page_size=4)  # 16 tokens in all: two long sequences cannot both fit
    for rid in ("a", "b"):
        engine.submit(item(rid, list(range(1, 7)), max_tokens=9, ignore_eos=True))
    for _ in range(40):
        for r in engine.step():
            if not r.stop:
                engine.submit(item(r.request_id, r.outputs["token"]))
        if not engine.has_work():
            break
    assert engine.stats()["preemptions"] >= 1 and engine.stats()["kv_pages_used"] == 0


class _Echo(StatelessBase):
    def run_batch(self, walk, node, inputs, options):
        return [{"y": i["x"]} for i in inputs]


def test_stateless_stats_are_queue_depth_and_batch():
    engine = StatelessEngine(_Echo(), StatelessSpec(max_batch_size=2))
    for rid in "abc":
        engine.submit(StepItem(rid, "w", "n", {"x": torch.zeros(1)}))
    assert engine.stats() == {"queue_depth": 3}
    engine.step()
    assert engine.last_step_items == 2 and engine.stats() == {"queue_depth": 1}
    engine.release("c")
    assert engine.stats() == {"queue_depth": 0}


def test_reporter_sends_first_then_only_changes_and_buckets_steps(monkeypatch):
    engine = SimpleNamespace(stats=lambda: {"queue_depth": engine.depth}, depth=0)
    sent = []
    plain = SimpleNamespace(stats=dict)  # an engine with no gauges
    reporter = StatsReporter(3, {"enc": engine, "plain": plain}, sent.append, interval_s=0.0)
    assert reporter.maybe_send() and sent[-1].rank == 3
    assert not reporter.maybe_send()  # nothing changed: nothing sent
    reporter.record("enc", 0.003, 3)
    reporter.record("enc", 20.0, 600)
    reporter.record("enc", 0.001, 0)  # ran nothing: not counted
    engine.depth = 5
    assert reporter.maybe_send()
    enc, plain = sent[-1].components
    assert enc.gauges == {"queue_depth": 5.0} and plain.gauges == {} and plain.steps == 0
    assert enc.steps == 2 and enc.batch_items_sum == 603 and enc.step_seconds_sum == pytest.approx(20.003)
    assert enc.step_seconds_buckets[wire.STEP_SECONDS_BOUNDS.index(0.005)] == 1 and enc.step_seconds_buckets[-1] == 1
    assert enc.batch_size_buckets[wire.BATCH_SIZE_BOUNDS.index(4)] == 1 and enc.batch_size_buckets[-1] == 1


def test_reporter_waits_for_the_interval():
    engine = SimpleNamespace(stats=lambda: {"queue_depth": engine.depth}, depth=0)
    sent = []
    reporter = StatsReporter(0, {"enc": engine}, sent.append, interval_s=60.0)
    assert reporter.maybe_send()
    engine.depth = 1
    assert not reporter.maybe_send() and len(sent) == 1  # changed, but the interval has not passed


def test_reporter_sends_at_once_when_the_worker_turns_busy_or_idle(monkeypatch):
    """A burst shorter than the interval still shows: turning busy and turning idle each send."""
    clock = [100.0]
    monkeypatch.setattr("mstar.worker.stats.time.perf_counter", lambda: clock[0])
    engine = SimpleNamespace(stats=lambda: {"queue_depth": engine.depth}, depth=0)
    sent = []
    reporter = StatsReporter(0, {"enc": engine}, sent.append, interval_s=60.0)
    assert reporter.maybe_send(busy=False)  # the first snapshot
    clock[0] += 1.0
    engine.depth = 4
    reporter.record("enc", 0.01, 4)
    assert reporter.maybe_send(busy=True) and sent[-1].components[0].steps == 1  # turned busy
    reporter.record("enc", 0.01, 4)
    assert not reporter.maybe_send(busy=True)  # still busy: waits for the interval
    clock[0] += 0.01
    engine.depth = 0
    assert not reporter.maybe_send(busy=False)  # turned idle, but within MIN_GAP_S of the last send
    clock[0] += 0.1
    assert reporter.maybe_send(busy=False)  # the pending turn goes out once the gap has passed
    assert sent[-1].components[0].steps == 2 and sent[-1].components[0].gauges == {"queue_depth": 0.0}
    assert not reporter.maybe_send(busy=False) and len(sent) == 3


def test_worker_stats_roundtrip_msgpack():
    from mstar.transport.messages import Codec

    msg = wire.WorkerStats(1, [wire.ComponentStats("llm", {"kv_pages_used": 3.0}, 2, 0.5, [0, 2], 7, [1, 1])])
    codec = Codec(wire.Message)
    assert codec.decode(codec.encode(msg)) == msg


def _fake_runtime(reports: dict[int, wire.WorkerStats]):
    conductor = SimpleNamespace(stats=lambda: {"in_flight": 2, "queued": 1}, worker_stats=lambda: reports)
    return SimpleNamespace(conductor=conductor)


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(metrics.render()[0].decode()) for s in f.samples}


def test_collector_exposes_gauges_ratio_counters_and_histograms():
    step_buckets = [0] * (len(wire.STEP_SECONDS_BOUNDS) + 1)
    step_buckets[0], step_buckets[3] = 2, 1  # two steps <= 0.5 ms, one <= 5 ms
    size_buckets = [0] * (len(wire.BATCH_SIZE_BOUNDS) + 1)
    size_buckets[2] = 3  # three steps of 3-4 items
    gauges = {"queue_depth": 4, "kv_pages_used": 25, "kv_pages_total": 100, "seqs_running": 2, "preemptions": 7}
    llm = wire.ComponentStats("llm", gauges, 3, 0.006, step_buckets, 11, size_buckets)
    s = _samples(ServerMetrics(_fake_runtime({1: wire.WorkerStats(1, [llm])})))
    labels = (("component", "llm"), ("rank", "1"))

    def le(bound: str) -> tuple:
        return tuple(sorted(labels + (("le", bound),)))

    assert s[("mstar_requests_in_flight", ())] == 2 and s[("mstar_requests_queued", ())] == 1
    assert s[("mstar_component_queue_depth", labels)] == 4
    assert s[("mstar_kv_cache_pages_used", labels)] == 25 and s[("mstar_kv_cache_usage_ratio", labels)] == 0.25
    assert s[("mstar_sequences_running", labels)] == 2 and s[("mstar_preemptions_total", labels)] == 7
    assert s[("mstar_component_step_seconds_bucket", le("0.0005"))] == 2
    assert s[("mstar_component_step_seconds_bucket", le("0.005"))] == 3
    assert s[("mstar_component_step_seconds_count", labels)] == 3
    assert s[("mstar_component_batch_size_bucket", le("2.0"))] == 0
    assert s[("mstar_component_batch_size_bucket", le("4.0"))] == 3
    assert s[("mstar_component_batch_size_sum", labels)] == 11


def test_each_series_name_is_exposed_once():
    """The engine's prompt-token counter and the requests' are two families; one name for both gave two TYPE
    lines for mstar_prompt_tokens_total, which summed each prompt twice."""
    llm = wire.ComponentStats("llm", {"prompt_tokens": 5.0}, 1, 0.001, [1], 1, [1])
    metrics = ServerMetrics(_fake_runtime({0: wire.WorkerStats(0, [llm])}))
    metrics.finished("stop", 200, prompt_tokens=5)
    text = metrics.render()[0].decode()
    types = re.findall(r"^# TYPE (\S+) ", text, re.M)
    assert len(types) == len(set(types)), sorted(t for t in types if types.count(t) > 1)
    s = _samples(metrics)
    assert s[("mstar_component_prompt_tokens_total", (("component", "llm"), ("rank", "0")))] == 5
    assert s[("mstar_prompt_tokens_total", ())] == 5


def test_first_output_histograms_by_modality():
    metrics = ServerMetrics(_fake_runtime({}))
    metrics.first_of("text", 0.2)
    metrics.first_of("speech_audio", 0.4)
    metrics.first_of("logits", 1.0)  # no modality: not recorded
    metrics.inter_output(0.01, "text")
    metrics.inter_output(0.05, "audio")  # not a token
    s = _samples(metrics)
    assert s[("mstar_time_to_first_token_seconds_sum", (("output", "text"),))] == 0.2
    assert s[("mstar_time_to_first_audio_seconds_count", (("output", "speech_audio"),))] == 1
    assert s[("mstar_inter_token_latency_seconds_count", ())] == 1
    assert [output_modality(n) for n in ("image", "video", "context", "x_text")] == ["image", "video", None, "text"]


def test_conductor_keeps_latest_stats_per_live_worker():
    from mstar.conductor.conductor import Conductor
    from mstar.config import config_from_dict
    from mstar.graph.placement import plan_placement
    from mstar.runtime.build import build_model
    from mstar.runtime.codecs import LocalCodec

    config = config_from_dict({"model": "toy"})
    graph = build_model(config).graph()
    conductor = Conductor(graph, plan_placement(graph, config.node_groups, config.source), lambda *a: None,
                          LocalCodec(), max_concurrent=4, max_queued=4)
    old, new = wire.WorkerStats(0, []), wire.WorkerStats(0, [wire.ComponentStats("x", {}, 0, 0.0, [], 0, [])])
    conductor.handle(old)
    conductor.handle(new)
    assert conductor.worker_stats() == {0: new}
    conductor.worker_died(0, "test")
    conductor.handle(old)  # a late report of the dead worker
    assert conductor.worker_stats() == {}
