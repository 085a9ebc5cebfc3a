"""Run a real uvicorn server over a toy Runtime in a background thread, on a free 127.0.0.1 port."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from mstar.config import config_from_dict
from mstar.runtime.launcher import Runtime
from mstar.server.app import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(config: dict, api_key: str | None = None, runtime_kwargs: dict | None = None,
                   tiny: bool = False, **app_kwargs):
    """Yield the base URL of a live server; stop uvicorn and the runtime afterwards.

    `runtime_kwargs` go to `Runtime` (e.g. `mode="multiproc"`), `tiny=True` is --tiny, `app_kwargs`
    go to `create_app`.
    """
    kwargs = {**(runtime_kwargs or {}), **({"tiny": True} if tiny else {})}
    runtime = Runtime(config_from_dict(config), **kwargs)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(runtime, api_key=api_key, **app_kwargs), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        runtime.shutdown()


def in_flight(base: str, headers: dict | None = None) -> float:
    """The mstar_requests_in_flight gauge scraped from /metrics."""
    text = httpx.get(f"{base}/metrics", headers=headers or {}).text
    for line in text.splitlines():
        if line.startswith("mstar_requests_in_flight "):
            return float(line.split()[1])
    raise AssertionError("no mstar_requests_in_flight in /metrics")


def scrape(base: str, headers: dict | None = None) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of /metrics: sample name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", headers=headers or {}).text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def metric_sum(samples: dict, name: str, **labels: str) -> float | None:
    """The sum of `name`'s samples whose labels include `labels`; None when there is none."""
    values = [v for lab, v in samples.get(name, []) if labels.items() <= lab.items()]
    return sum(values) if values else None
