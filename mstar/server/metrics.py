"""Prometheus metrics of one server: load, latencies, outcomes, and every worker's engine load.

Each app gets its own registry, so several servers (tests) can live in one process. Request and
engine load are read at scrape time: request counts from the conductor, engine gauges and step
histograms from the latest `WorkerStats` each worker sent (about twice a second). docs/metrics.md
lists every series.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mstar.transport import wire

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MODALITIES = ("text", "audio", "image", "video")
_FIRST_NAMES = {"text": "token", "audio": "audio", "image": "image", "video": "video"}
# Engine stats key (mstar.engines.base.Engine.stats) -> gauge name and help.
_ENGINE_GAUGES = {
    "queue_depth": ("mstar_component_queue_depth", "items submitted to the component's engine, not yet answered"),
    "kv_pages_used": ("mstar_kv_cache_pages_used", "KV cache pages held by live sequences"),
    "kv_pages_cached": ("mstar_kv_cache_pages_cached", "idle KV pages kept for prefix reuse (evictable)"),
    "kv_pages_total": ("mstar_kv_cache_pages_total", "KV cache pages in the pool"),
    "seqs_running": ("mstar_sequences_running", "autoregressive sequences holding KV pages"),
    "seqs_waiting": ("mstar_sequences_waiting", "autoregressive sequences waiting for KV pages"),
}
_ENGINE_COUNTERS = {
    "preemptions": ("mstar_preemptions", "sequences preempted (pages freed, recomputed later)"),
    # not mstar_prompt_tokens: that is the request series (prompt tokens of ended requests)
    "prompt_tokens": ("mstar_component_prompt_tokens", "prompt tokens the engine computed"),
    "kv_pages_sent": ("mstar_kv_pages_sent", "KV pages sent to another worker's engine"),
    "kv_pages_received": ("mstar_kv_pages_received", "KV pages received from another worker's engine"),
    "kv_pages_reused": ("mstar_kv_pages_reused", "pages of a moved sequence found in the prefix cache, not sent"),
}
_LABELS = ("component", "rank")


def output_modality(name: str) -> str | None:
    """The modality of output `name`: "audio" for `audio` or `*_audio`, and so on; None if none fits."""
    return next((m for m in MODALITIES if name == m or name.endswith(f"_{m}")), None)


class _LoadCollector:
    """Reads in-flight and queued counts from the conductor at scrape time."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        stats = self.runtime.conductor.stats()
        yield GaugeMetricFamily("mstar_requests_in_flight", "requests admitted and running", value=stats["in_flight"])
        yield GaugeMetricFamily("mstar_requests_queued", "requests waiting for admission", value=stats["queued"])


class _EngineCollector:
    """Per component and rank: engine gauges, KV usage, step time and batch size histograms."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        reports = [(str(rank), c) for rank, ws in sorted(self.runtime.conductor.worker_stats().items())
                   for c in ws.components]
        gauges = {k: GaugeMetricFamily(n, h, labels=_LABELS) for k, (n, h) in _ENGINE_GAUGES.items()}
        counters = {k: CounterMetricFamily(n, h, labels=_LABELS) for k, (n, h) in _ENGINE_COUNTERS.items()}
        ratio = GaugeMetricFamily("mstar_kv_cache_usage_ratio", "KV pages used / pages in the pool", labels=_LABELS)
        step = HistogramMetricFamily("mstar_component_step_seconds", "duration of one engine step that ran work",
                                     labels=_LABELS)
        batch = HistogramMetricFamily("mstar_component_batch_size", "items (sequences, rows) computed per step",
                                      labels=_LABELS)
        for rank, comp in reports:
            labels = [comp.component, rank]
            for key, value in comp.gauges.items():
                family = gauges.get(key) or counters.get(key)
                if family is not None:
                    family.add_metric(labels, value)
            total = comp.gauges.get("kv_pages_total")
            if total:
                ratio.add_metric(labels, comp.gauges.get("kv_pages_used", 0.0) / total)
            step.add_metric(labels, _cumulative(wire.STEP_SECONDS_BOUNDS, comp.step_seconds_buckets),
                            comp.step_seconds_sum)
            batch.add_metric(labels, _cumulative(wire.BATCH_SIZE_BOUNDS, comp.batch_size_buckets),
                             float(comp.batch_items_sum))
        yield from gauges.values()
        yield from counters.values()
        yield from (ratio, step, batch)


def _cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus buckets (cumulative, "+Inf" last) from per-bucket counts."""
    out, running = [], 0
    for bound, count in zip((*bounds, float("inf")), counts):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(running)))
    return out


class ServerMetrics:
    """The metrics one server exposes on /metrics."""

    def __init__(self, runtime: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.registry.register(_LoadCollector(runtime))
        self.registry.register(_EngineCollector(runtime))
        self._ttfo = Histogram("mstar_time_to_first_output_seconds", "submit to the first value of any output",
                               buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._first = {m: Histogram(f"mstar_time_to_first_{_FIRST_NAMES[m]}_seconds",
                                    f"submit to the first value of each {m} output", ("output",),
                                    buckets=_LATENCY_BUCKETS, registry=self.registry) for m in MODALITIES}
        self._itl = Histogram("mstar_inter_output_latency_seconds", "time between consecutive values of any output",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._itt = Histogram("mstar_inter_token_latency_seconds", "time between consecutive values of a text output",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._started = Counter("mstar_requests_started", "requests submitted to the runtime", registry=self.registry)
        self._finished = Counter("mstar_requests_finished", "requests ended, by finish reason and status",
                                 ("finish_reason", "status"), registry=self.registry)
        self._http = Counter("mstar_http_responses", "HTTP responses by route and status code",
                             ("route", "status"), registry=self.registry)
        self._prompt_tokens = Counter("mstar_prompt_tokens", "prompt tokens of ended requests", registry=self.registry)
        self._generation_tokens = Counter("mstar_generation_tokens", "tokens generated by ended requests",
                                          registry=self.registry)

    def started(self) -> None:
        """One request was submitted."""
        self._started.inc()

    def first_output(self, seconds: float) -> None:
        """A request's first value of any output came `seconds` after submission."""
        self._ttfo.observe(seconds)

    def first_of(self, output: str, seconds: float) -> None:
        """A request's first value of `output` came `seconds` after submission (outputs of unknown
        modality are not recorded)."""
        modality = output_modality(output)
        if modality is not None:
            self._first[modality].labels(output).observe(seconds)

    def inter_output(self, seconds: float, output: str | None = None) -> None:
        """`seconds` between consecutive values (of `output`, when given: text outputs feed inter-token)."""
        if output is None:
            self._itl.observe(seconds)
        elif output_modality(output) == "text":
            self._itt.observe(seconds)

    def finished(self, finish_reason: str | None, status: int, prompt_tokens: int = 0,
                 generation_tokens: int = 0) -> None:
        """One request ended, having read `prompt_tokens` and generated `generation_tokens`."""
        self._finished.labels(finish_reason or "none", str(status)).inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(generation_tokens)

    def http_response(self, route: str, status: int) -> None:
        """One HTTP response started."""
        self._http.labels(route, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
