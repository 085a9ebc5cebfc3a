"""A 50 MB prompt sent four times to a server in this process (the toy or the tiny Llama); prints one JSON line:
[RSS before in MB, [[status, error message] per request], [[RSS now, peak RSS since before] per request]].
Run in a fresh process by tests/e2e/test_abuse.py, so that the peak is this server's alone.

    python3 -m tests.e2e.big_prompt_memory llama
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
import time

import httpx

from tests.e2e.server_thread import running_server


def reset_peak_rss() -> None:
    """Start this process's peak resident memory (VmHWM) over from what it holds now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss_mb() -> tuple[float, float]:
    """This process's resident memory now and at its peak since `reset_peak_rss`, in MB (the server runs in
    it). "Now" is read once what was freed has gone back to the system (a collection, then glibc's trim), the
    least of a few reads while the server's threads finish with the last request: memory malloc merely kept
    is no accumulation."""
    reads = []
    for _ in range(3):
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/statm") as f:
            reads.append(int(f.read().split()[1]) * 4096 / 2**20)
        time.sleep(0.05)
    with open("/proc/self/status") as f:
        peak_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return min(reads), peak_kb / 1024


def main(model: str) -> None:
    config = {"model": model, "device": "cpu", "kv_cache": {"max_num_pages": 64}} if model == "llama" else {"model": model}
    body = b'{"text": "' + b"lorem ipsum dolor sit amet " * (50_000_000 // 27) + b'", "stream": false}'
    with running_server(config, tiny=model == "llama") as url, httpx.Client(base_url=url, timeout=60) as client:
        before = rss_mb()[0]
        reset_peak_rss()
        answers, rss = [], []
        for _ in range(4):
            resp = client.post("/generate", content=body, headers={"content-type": "application/json"})
            answers.append([resp.status_code, resp.json()["error"]["message"]])
            rss.append(rss_mb())
    print(json.dumps([before, answers, rss]))


if __name__ == "__main__":
    main(sys.argv[1])
