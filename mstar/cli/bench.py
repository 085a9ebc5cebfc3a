"""`mstar bench`: a closed-loop HTTP load client for a running mstar (or any OpenAI-compatible) server.

For each concurrency level N of the sweep, N workers each keep one request in flight until
`num_requests` have been sent or `duration` seconds have passed (in-flight requests then finish and
count). Workloads: `chat` (streamed /v1/chat/completions) and `speech` (/v1/audio/speech streaming
16-bit mono PCM). Latencies are measured on the client; before each level's clock starts the client
sends one untimed GET /health, so its own first use of its HTTP stack is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from mstar.cli.bench_report import format_table, summarize
from mstar.cli.bench_requests import RequestRecord, chat_body, run_chat, run_speech, speech_body

logger = logging.getLogger(__name__)

WORKLOADS = ("chat", "speech")
DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
DEFAULT_SPEECH_TEXT = "The quick brown fox jumps over the lazy dog. Streaming speech should start quickly."


@dataclass(frozen=True)
class BenchConfig:
    """What to send, where, and how much load to apply."""

    base_url: str = "http://127.0.0.1:8000"
    workload: str = "chat"
    """'chat' or 'speech'"""
    model: str = "default"
    concurrencies: tuple[int, ...] = (1,)
    """the sweep: requests kept in flight, one level after another"""
    num_requests: int | None = None
    """requests per level (default 10 * concurrency when no duration is given)"""
    duration_s: float | None = None
    """seconds per level during which new requests are sent"""
    prompt: str | None = None
    """chat prompt or speech text (a default per workload when None)"""
    max_tokens: int = 128
    ignore_eos: bool = False
    voice: str | None = None
    sample_rate: int = 24000
    """PCM rate used to turn bytes into audio seconds (16-bit mono)"""
    timeout_s: float = 600.0
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    """merged into every request body"""

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {list(WORKLOADS)}")
        if not self.concurrencies or any(c < 1 for c in self.concurrencies):
            raise ValueError(f"concurrency levels must be >= 1, got {list(self.concurrencies)}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration_s}")
        if self.sample_rate <= 0:
            raise ValueError(f"sample_rate must be > 0, got {self.sample_rate}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout_s}")

    def request(self) -> tuple[Any, dict]:
        """The coroutine function and body every request of this run uses."""
        if self.workload == "chat":
            body = chat_body(self.model, self.prompt or DEFAULT_PROMPT, self.max_tokens, self.ignore_eos,
                             self.extra_body)
            return run_chat, body
        return run_speech, speech_body(self.model, self.prompt or DEFAULT_SPEECH_TEXT, self.voice,
                                       self.extra_body, self.max_tokens, self.ignore_eos)


async def _one(send, client, body: dict) -> RequestRecord:
    try:
        return await send(client, body)
    except Exception as exc:  # a failed request is a data point, not the end of the benchmark
        logger.debug("request failed", exc_info=True)
        return RequestRecord(error=f"{type(exc).__name__}: {exc}")


async def _warm_client(client) -> None:
    """One untimed GET /health (any answer will do; other servers may lack the route) before a level's
    clock starts, so the client's own first use of its HTTP stack (anyio's backend, the first connection)
    is not timed as the first request's latency. The model is not touched."""
    try:
        await client.get("/health")
    except Exception:  # noqa: BLE001 - a server without /health, or one not up: the level reports it
        logger.debug("warm-up GET /health failed", exc_info=True)


async def _level(config: BenchConfig, concurrency: int) -> dict:
    """Run one concurrency level closed-loop and summarize it."""
    import httpx

    send, body = config.request()
    budget = config.num_requests
    if budget is None and config.duration_s is None:
        budget = 10 * concurrency
    records: list[RequestRecord] = []
    issued = 0
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=config.base_url, timeout=config.timeout_s, headers=headers,
                                 limits=limits, trust_env=False) as client:
        await _warm_client(client)
        start = time.perf_counter()
        deadline = None if config.duration_s is None else start + config.duration_s

        async def worker() -> None:
            nonlocal issued
            while (budget is None or issued < budget) and (deadline is None or time.perf_counter() < deadline):
                issued += 1  # single-threaded event loop: no lock needed
                records.append(await _one(send, client, body))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summarize(records, wall, concurrency, config.workload, config.sample_rate)


def run_bench(config: BenchConfig, command: str | None = None,
              on_level: Callable[[dict], None] | None = None) -> dict:
    """Run the sweep against a live server and return a JSON-ready report: the command line, the config,
    and one summary per concurrency level (see `bench_report.summarize` for the fields). `on_level` gets
    the report as it stands after each level (a long sweep cut short keeps the levels it finished)."""
    report = {"command": command, "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
              "config": dataclasses.asdict(config) | {"api_key": None}, "results": []}
    for concurrency in config.concurrencies:
        logger.info("bench %s: concurrency %d", config.workload, concurrency)
        report["results"].append(asyncio.run(_level(config, concurrency)))
        if on_level is not None:
            on_level(report)
    return report


def _concurrencies(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--concurrency wants comma-separated integers, got {text!r}") from exc
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency levels must be >= 1, got {text!r}")
    return levels


def _positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` above zero, so a bad value is argparse's one line."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value
    return parse


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"wants a JSON object, got {text!r}")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` on an argparse subparsers object; the parsed args go to `main`."""
    parser = subparsers.add_parser("bench", help="drive a running server with closed-loop load",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    parser.set_defaults(func=main)
    return parser


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument("--workload", choices=WORKLOADS, default="chat")
    p.add_argument("--model", default="default", help="the `model` field sent in each request")
    p.add_argument("--concurrency", type=_concurrencies, default=(1,), help="sweep, e.g. 1,4,8")
    p.add_argument("--num-requests", type=_positive(int), default=None,
                   help="requests per level (default 10 x conc.)")
    p.add_argument("--duration", type=_positive(float), default=None, help="seconds per level instead of a count")
    p.add_argument("--prompt", default=None, help="chat prompt or text to speak")
    p.add_argument("--max-tokens", type=_positive(int), default=128)
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to generate max_tokens")
    p.add_argument("--voice", default=None)
    p.add_argument("--sample-rate", type=_positive(int), default=24000, help="PCM rate of speech responses")
    p.add_argument("--timeout", type=_positive(float), default=600.0, help="per-request timeout, seconds")
    p.add_argument("--api-key", default=None)
    p.add_argument("--extra-body", type=_json_object, default={}, help="JSON object merged into each body")
    p.add_argument("--output", default=None, help="write the JSON report here")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig described by parsed `bench` arguments."""
    return BenchConfig(base_url=args.base_url, workload=args.workload, model=args.model,
                       concurrencies=tuple(args.concurrency), num_requests=args.num_requests,
                       duration_s=args.duration, prompt=args.prompt, max_tokens=args.max_tokens,
                       ignore_eos=args.ignore_eos, voice=args.voice, sample_rate=args.sample_rate,
                       timeout_s=args.timeout, api_key=args.api_key, extra_body=args.extra_body)


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    """Run `mstar bench`: print the table, write `--output` JSON. Accepts parsed args or an argv list."""
    command = shlex.join(sys.argv)
    if not isinstance(args, argparse.Namespace):
        command = shlex.join(["mstar", "bench", *(sys.argv[1:] if args is None else args)])
        parser = argparse.ArgumentParser(prog="mstar bench", description=__doc__)
        _add_arguments(parser)
        args = parser.parse_args(args)
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        # found before the sweep runs, not when its report is written
        sys.stderr.write(f"mstar bench: argument --output: no folder {os.path.dirname(args.output)!r}\n")
        raise SystemExit(2)
    config = config_from_args(args)

    def level_done(report: dict) -> None:  # progress, and a file that holds every level finished so far
        row = format_table(report["results"][-1:], config.workload).splitlines()[1]
        sys.stderr.write(f"level done: {row.strip()}\n")
        if args.output:
            _write(args.output, report)

    report = run_bench(config, command=command, on_level=level_done)
    sys.stdout.write(format_table(report["results"], config.workload))
    for sample in sorted({e for r in report["results"] for e in r["error_samples"]})[:5]:
        sys.stderr.write(f"failed request: {sample}\n")
    if args.output:
        _write(args.output, report)
        logger.info("wrote %s", args.output)
    return 0 if all(r["completed"] for r in report["results"]) else 1


def _write(path: str, report: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
