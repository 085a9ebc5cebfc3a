"""Prometheus metrics of one server: load, latencies and outcomes.

Each app gets its own registry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

from typing import Any

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _LoadCollector:
    """Reads in-flight and queued counts from the conductor at scrape time."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        stats = self.runtime.conductor.stats()
        yield GaugeMetricFamily("mstar_requests_in_flight", "requests admitted and running", value=stats["in_flight"])
        yield GaugeMetricFamily("mstar_requests_queued", "requests waiting for admission", value=stats["queued"])


class ServerMetrics:
    """The metrics one server exposes on /metrics."""

    def __init__(self, runtime: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.registry.register(_LoadCollector(runtime))
        self._ttfo = Histogram("mstar_time_to_first_output_seconds", "submit to first output value",
                               buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._itl = Histogram("mstar_inter_output_latency_seconds", "time between consecutive outputs (tokens)",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._started = Counter("mstar_requests_started", "requests submitted to the runtime", registry=self.registry)
        self._finished = Counter("mstar_requests_finished", "requests ended, by finish reason and status",
                                 ("finish_reason", "status"), registry=self.registry)
        self._http = Counter("mstar_http_responses", "HTTP responses by route and status code",
                             ("route", "status"), registry=self.registry)

    def started(self) -> None:
        self._started.inc()

    def first_output(self, seconds: float) -> None:
        self._ttfo.observe(seconds)

    def inter_output(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def finished(self, finish_reason: str | None, status: int) -> None:
        self._finished.labels(finish_reason or "none", str(status)).inc()

    def http_response(self, route: str, status: int) -> None:
        self._http.labels(route, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
