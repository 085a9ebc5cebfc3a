"""The server starts the worker-thread pool that requests build their inputs in before it accepts any
request, so the first request does not pay for starting it (anyio imports and starts its thread backend
on first use: measured at ~0.35 s of a --tiny Orpheus server's first time to audio on the dev machine)."""

from __future__ import annotations

import asyncio

from mstar.server import app as app_module
from tests.e2e.server_thread import running_server


def test_lifespan_runs_the_thread_pool_before_serving(monkeypatch):
    used = []

    async def recording(fn, *args):
        used.append(fn)
        return fn(*args)

    monkeypatch.setattr(app_module, "run_in_threadpool", recording)

    async def start() -> list:
        async with app_module._warm_lifespan(None):
            return list(used)

    assert len(asyncio.run(start())) == 1  # once, before the app yields to serving


def test_served_app_runs_it_at_startup(monkeypatch):
    used = []
    real = app_module.run_in_threadpool

    async def recording(fn, *args):
        used.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(app_module, "run_in_threadpool", recording)
    with running_server({"model": "toy"}):
        assert len(used) == 1, "the app did not start its thread pool before serving"
