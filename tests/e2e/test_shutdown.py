"""`mstar serve` under SIGTERM (or Ctrl-C twice) with streams open: no new connection and no 200 from
/ready after it, every open stream ends with an in-band error before the shutdown timeout (at once on the
second Ctrl-C), and the process exits within it, printing no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.e2e.server_thread import free_port

STREAMS = 20
TIMEOUT_S = 2.0


def _stream(url: str, lines: list[list[str]], opened: threading.Semaphore) -> None:
    got: list[str] = []
    lines.append(got)
    try:
        with httpx.stream("POST", f"{url}/generate", json={"text": "x", "outputs": ["text"], "options": {
                "max_tokens": 100_000, "stop_early": False}}, timeout=60) as resp:
            for line in resp.iter_lines():
                if not got:
                    opened.release()
                got.append(line)
    except httpx.HTTPError as exc:
        got.append(f"transport error: {exc}")


@pytest.mark.parametrize("signals,timeout_s,within_s", [
    ((signal.SIGTERM,), TIMEOUT_S, TIMEOUT_S + 3),  # the drain's deadline ends the streams
    pytest.param((signal.SIGINT, signal.SIGINT), 60.0, 10.0,  # Ctrl-C twice: ended at once, long before the timeout
                 marks=pytest.mark.slow),
])
def test_a_signal_with_twenty_streams_open_exits_within_the_timeout(tmp_path, signals, timeout_s, within_s):
    config = tmp_path / "slow_toy.yaml"
    config.write_text("model: toy\nmodel_kwargs: {step_delay_s: 0.02}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "mstar.cli.main", "serve", "--config", str(config), "--port",
                             str(port), "--shutdown-timeout", str(timeout_s), "--log-level", "WARNING"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        lines: list[list[str]] = []
        opened = threading.Semaphore(0)
        threads = [threading.Thread(target=_stream, args=(url, lines, opened)) for _ in range(STREAMS)]
        for thread in threads:
            thread.start()
        for _ in range(STREAMS):
            assert opened.acquire(timeout=30)
        with httpx.Client(base_url=url, timeout=5) as client:  # a connection opened before the signal
            assert client.get("/ready").status_code == 200
            sent = time.monotonic()
            for sig in signals:
                proc.send_signal(sig)
                time.sleep(0.3)
            try:  # uvicorn closes idle connections and the listener at once; an answer must say draining
                assert client.get("/ready").status_code == 503
            except httpx.TransportError:
                pass
        code = proc.wait(timeout=timeout_s + 10)
        took = time.monotonic() - sent
        for thread in threads:
            thread.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()
    assert code == 0 and "Traceback" not in stderr, stderr[-3000:]
    assert took < within_s, took
    assert len(lines) == STREAMS
    for got in lines:  # each stream's last line is the in-band error naming the shutdown
        last = json.loads(got[-1])
        assert last["type"] == "error" and last["status"] == 503 and "shutting down" in last["message"], got[-1]
