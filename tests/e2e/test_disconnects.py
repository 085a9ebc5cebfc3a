"""Clients that go away cancel their requests: nothing stays in flight afterwards."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.e2e.server_thread import in_flight, running_server

SLOW = {"model": "toy", "model_kwargs": {"step_delay_s": 0.02}, "max_concurrent_requests": 64}


@pytest.fixture(scope="module")
def base():
    with running_server(SLOW) as url:
        yield url


def _wait_idle(base: str, timeout_s: float = 10.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (value := in_flight(base)) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


async def _stream_and_leave(client: httpx.AsyncClient, path: str, body: dict, reading: asyncio.Queue,
                            leave: asyncio.Event) -> int:
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        lines = 0
        async for line in resp.aiter_lines():
            lines += bool(line.strip())
            if lines == 2:
                reading.put_nowait(1)
                await leave.wait()
                return lines  # leaving the block closes the connection mid-stream
    return lines


def test_fifty_streaming_clients_disconnecting_leave_nothing_in_flight(base):
    chat = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 500, "stream": True, "stop_early": False}
    native = {"text": "go", "stream": True, "options": {"max_tokens": 500, "stop_early": False}}

    async def run() -> float:
        async with httpx.AsyncClient(base_url=base, timeout=30, limits=httpx.Limits(max_connections=100)) as client:
            reading, leave = asyncio.Queue(), asyncio.Event()
            tasks = [asyncio.create_task(_stream_and_leave(client, "/v1/chat/completions" if i % 2 else "/generate",
                                                           chat if i % 2 else native, reading, leave))
                     for i in range(50)]
            for _ in tasks:
                await asyncio.wait_for(reading.get(), timeout=30)
            busy = await asyncio.to_thread(in_flight, base)  # every client is mid-stream now
            leave.set()
            counts = await asyncio.gather(*tasks)
            assert all(c >= 2 for c in counts)
            return busy

    peak = asyncio.run(run())
    assert peak == 50  # every request was really running when its client left
    assert _wait_idle(base) == 0


def test_non_streaming_client_timeout_cancels(base):
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 500, "stop_early": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/chat/completions", json=body, timeout=0.5)
    assert _wait_idle(base) == 0
    assert httpx.get(f"{base}/health").status_code == 200
