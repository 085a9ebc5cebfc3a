"""Soak a CPU server with mixed, hostile traffic and report what it leaked.

Starts `mstar-serve` (the toy on two worker processes, then the tiny Llama in one process), sends
`--requests` requests per server from `--clients` concurrent clients: good requests on every route the
model serves (streamed and not), clients that leave mid-stream, and random bad input; on the toy it
kills one worker halfway. Then it waits for the server to go idle and reports requests served, answers
by kind and status, requests and KV pages still held, shared-memory segments left, and the server's
RSS growth. Bounded: every request has a timeout, and `--max-seconds` ends each phase.

    python3 benchmarks/soak.py --requests 2500 --out benchmarks/results/soak_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SERVERS = {  # name -> (mstar-serve arguments, kill a worker halfway)
    "toy_2workers": (["--config", "toy_2workers", "--mode", "multiproc"], True),
    "llama_tiny": (["--model", "llama", "--tiny", "--mode", "inproc"], False),
}
BAD = [  # (route, body): each must be a 4xx
    ("/generate", {"text": "x", "options": {"max_tokens": -3}}),
    ("/generate", {"text": "x", "options": {"max_tokens": 2.5}}),
    ("/generate", {"text": "x", "options": {"max_tokens": "ten"}}),
    ("/generate", {"text": "x", "options": {"a": [[[[[[[[[[1]]]]]]]]]]}}),
    ("/generate", {"media": [{"type": "image", "data": "bm90IGFuIGltYWdl"}], "text": "x"}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}),
    ("/v1/completions", {"prompt": ["p"] * 100, "max_tokens": 2}),
]
RAW_BAD = [b"{not json", b"[" * 5000 + b"]" * 5000]


def _png_declaring(width: int, height: int) -> str:
    import struct
    import zlib

    data = bytearray(base64.b64decode(
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNgYGAAAAAEAAH2FzhVAAAAAElFTkSuQmCC"))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return base64.b64encode(bytes(data)).decode()


def good_requests(model: str) -> list[tuple[str, dict, bool]]:
    """(route, body, streamed) the model can serve."""
    chat = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8}
    reqs = [("/v1/chat/completions", chat, False), ("/v1/chat/completions", {**chat, "stream": True}, True),
            ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 6}, False)]
    if model == "toy":
        reqs += [("/generate", {"text": "hello", "outputs": ["text", "audio", "image"],
                                "options": {"max_tokens": 6}}, True),
                 ("/generate", {"text": "hi", "stream": False, "options": {"max_tokens": 4}}, False),
                 ("/v1/audio/speech", {"input": "hello there", "voice": "alloy"}, False)]
    else:
        reqs += [("/generate", {"text": "hello", "options": {"max_tokens": 8}}, True)]
    return reqs


async def one_request(client: httpx.AsyncClient, rng: random.Random, model: str, tally: Counter) -> None:
    roll = rng.random()
    try:
        if roll < 0.15:  # bad input of one kind or another
            if rng.random() < 0.25:
                resp = await client.post("/generate", content=rng.choice(RAW_BAD),
                                         headers={"content-type": "application/json"})
            elif rng.random() < 0.1:
                resp = await client.post("/generate", json={"text": "x", "media": [
                    {"type": "image", "data": _png_declaring(30000, 30000)}]})
            else:
                route, body = rng.choice(BAD)
                resp = await client.post(route, json=body)
            tally[f"bad {resp.status_code}"] += 1
        elif roll < 0.30:  # a streaming client that leaves after its first chunk
            async with client.stream("POST", "/generate", json={"text": "long", "options": {
                    "max_tokens": 400, **({"stop_early": False} if model == "toy" else {"ignore_eos": True})}}) as resp:
                async for _ in resp.aiter_lines():
                    break
            tally[f"left {resp.status_code}"] += 1
        else:
            route, body, streamed = rng.choice(good_requests(model))
            if streamed:
                async with client.stream("POST", route, json=body) as resp:
                    async for _ in resp.aiter_lines():
                        pass
            else:
                resp = await client.post(route, json=body)
            tally[f"good {resp.status_code}"] += 1
    except httpx.HTTPError as exc:
        tally[f"transport {type(exc).__name__}"] += 1


async def drive(base: str, model: str, requests: int, clients: int, max_seconds: float, seed: int,
                halfway) -> Counter:
    tally: Counter = Counter()
    rng = random.Random(seed)
    done, deadline = 0, time.monotonic() + max_seconds
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        async def worker() -> None:
            nonlocal done
            while done < requests and time.monotonic() < deadline:
                done += 1
                if done == requests // 2:
                    halfway()
                await one_request(client, rng, model, tally)

        await asyncio.gather(*(worker() for _ in range(clients)))
    return tally


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def idle_gauges(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    wanted = ("mstar_requests_in_flight", "mstar_requests_queued", "mstar_kv_cache_pages_used",
              "mstar_component_queue_depth", "mstar_sequences_running")
    out = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError("server not ready")


def soak(name: str, requests: int, clients: int, max_seconds: float, seed: int, port: int) -> dict:
    args, kill = SERVERS[name]
    session = f"soak{os.getpid()}{name.replace('_', '')}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MSTAR_SESSION": session}
    proc = subprocess.Popen([sys.executable, "-c", "from mstar.cli.main import serve_main; serve_main()", *args,
                             "--port", str(port), "--log-level", "ERROR"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    killed: list[int] = []

    def halfway() -> None:
        if kill:
            children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            workers = [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
            if workers:  # the last worker: the toy's vocoder rank
                os.kill(workers[-1], signal.SIGKILL)
                killed.append(workers[-1])

    try:
        wait_ready(base, proc)
        asyncio.run(drive(base, name.split("_")[0], 40, 4, 60, seed, lambda: None))  # warm every path
        rss_start, start = rss_mb(proc.pid), time.monotonic()
        tally = asyncio.run(drive(base, name.split("_")[0], requests, clients, max_seconds, seed, halfway))
        took = time.monotonic() - start
        if killed:
            wait_ready(base, proc)  # the killed worker is back
        time.sleep(1.0)  # workers report their gauges about twice a second
        gauges = idle_gauges(base)
        rss_end = rss_mb(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    segments = sorted(p.name for p in Path("/dev/shm").glob(f"mstar-{session}-*"))
    return {"server": name, "args": args, "requests": sum(tally.values()), "seconds": round(took, 1),
            "answers": dict(sorted(tally.items())), "killed_worker_pid": killed[0] if killed else None,
            "idle_gauges": gauges, "shm_segments_left": len(segments), "server_rss_mb_start": round(rss_start, 1),
            "server_rss_mb_end": round(rss_end, 1), "server_rss_growth_mb": round(rss_end - rss_start, 1),
            "exit_code": code}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2500, help="requests per server")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-seconds", type=float, default=900, help="end each phase by then")
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=list(SERVERS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8790)
    p.add_argument("--out", default=None, help="write the report here (JSON)")
    args = p.parse_args(argv)
    report = {"command": "python3 benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "phases": [soak(name, args.requests, args.clients, args.max_seconds, args.seed, args.port + i)
                         for i, name in enumerate(args.servers)]}
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
