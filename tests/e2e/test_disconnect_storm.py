"""50 streaming chat clients of the tiny Llama leave mid-stream: /metrics shows nothing left behind.

Each client reads a few SSE events of a long generation (ignore_eos, 440 tokens: several seconds of
decoding for 50 sequences) and closes its connection. Within a few seconds /metrics must show no
request in flight or queued, no engine item pending and no KV page held, in both run modes; the
server still answers /health and serves a new request.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.e2e.server_thread import metric_sum, running_server, scrape

CLIENTS = 50
LLAMA = {"model": "llama", "device": "cpu", "max_concurrent_requests": 64,
         "kv_cache": {"max_num_pages": 2048, "page_size": 16}}
LONG = {"messages": [{"role": "user", "content": "Tell me everything."}], "max_tokens": 440, "stream": True,
        "ignore_eos": True, "temperature": 1.0}
IDLE = {"mstar_requests_in_flight": 0, "mstar_requests_queued": 0, "mstar_component_queue_depth": 0,
        "mstar_kv_cache_pages_used": 0, "mstar_sequences_running": 0, "mstar_sequences_waiting": 0}


async def _read_then_leave(client: httpx.AsyncClient, events: int) -> int:
    async with client.stream("POST", "/v1/chat/completions", json=LONG) as resp:
        assert resp.status_code == 200
        seen = 0
        async for line in resp.aiter_lines():
            seen += line.startswith("data: ")
            if seen == events:
                return seen  # leaving the block closes the connection mid-stream
    return seen


async def _storm(base: str) -> list[int]:
    limits = httpx.Limits(max_connections=CLIENTS + 10)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        return await asyncio.gather(*(_read_then_leave(client, 2 + i % 7) for i in range(CLIENTS)))


def _wait_for(base: str, wanted: dict[str, float], timeout_s: float) -> dict:
    """Poll /metrics until every series in `wanted` sums to its value; the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(base)
        if all(metric_sum(samples, name) == value for name, value in wanted.items()):
            return samples
        if time.monotonic() > deadline:
            got = {name: metric_sum(samples, name) for name in wanted}
            raise AssertionError(f"/metrics not idle after {timeout_s} s: {got}")
        time.sleep(0.1)


@pytest.mark.parametrize("mode", ["inproc", pytest.param("multiproc", marks=pytest.mark.slow)])
def test_fifty_streaming_clients_leaving_free_everything(mode):
    with running_server(LLAMA, runtime_kwargs={"mode": mode, "tiny": True}) as base:
        before = _wait_for(base, {"mstar_kv_cache_pages_total": 2048}, timeout_s=10)  # first WorkerStats came
        assert metric_sum(before, "mstar_kv_cache_pages_used") == 0

        started = time.monotonic()
        events = asyncio.run(_storm(base))
        assert events == [2 + i % 7 for i in range(CLIENTS)]  # every client left mid-stream

        after = _wait_for(base, IDLE, timeout_s=5)
        assert time.monotonic() - started < 30
        # Cancelled, not finished: each request was still generating when its client left.
        assert metric_sum(after, "mstar_requests_finished_total", finish_reason="cancelled") == CLIENTS
        assert metric_sum(after, "mstar_requests_finished_total", finish_reason="length") is None
        assert metric_sum(after, "mstar_kv_cache_usage_ratio") == 0
        assert metric_sum(after, "mstar_component_step_seconds_count", component="llm") > 0
        assert metric_sum(after, "mstar_time_to_first_token_seconds_count", output="text") == CLIENTS

        assert httpx.get(f"{base}/health").json() == {"status": "ok"}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True}
        resp = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 5
        assert resp.json()["choices"][0]["finish_reason"] == "length"
