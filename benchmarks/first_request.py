"""Time to first token of the first requests a freshly started server answers: does the first one pay
for cold starts (imports, template compiles, thread pools) that later ones do not?

Start a server, wait until /ready, then:

    python3 benchmarks/first_request.py --base-url http://127.0.0.1:8000 [--requests 4] [--max-tokens 16]

The client first sends one untimed GET /health so that its own first use of its HTTP stack is not
timed. Streams /v1/chat/completions and prints one line per request: time to the first chunk (the
role-only delta, sent once the request's inputs are built and it is admitted), to the first delta with
text, and to the end. With --speech-format FMT it posts /v1/audio/speech instead (not streamed, in that
response_format) and prints the time to the first byte of the body and to the end. Measures, asserts
nothing.

    python3 benchmarks/first_request.py --base-url ... --speech-format aac --max-tokens 70
"""

from __future__ import annotations

import argparse
import json
import time

import httpx


def _has_text(line: str) -> bool:
    """Whether an SSE line carries generated text (not the role-only first chunk, not [DONE])."""
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[len("data: "):]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="default")
    parser.add_argument("--speech-format", default=None, metavar="FMT",
                        help="time /v1/audio/speech in this response_format (wav, mp3, opus, aac, flac, pcm) instead")
    args = parser.parse_args()
    with httpx.Client(base_url=args.base_url, timeout=120, trust_env=False) as client:
        client.get("/health")
        if args.speech_format:
            _speech(client, args)
            return
        body = {"model": args.model, "messages": [{"role": "user", "content": "Say hello in five words."}],
                "stream": True, "max_tokens": args.max_tokens}
        for i in range(args.requests):
            start, chunk, first = time.perf_counter(), None, None
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    if chunk is None and line.startswith("data: "):
                        chunk = time.perf_counter() - start
                    if first is None and _has_text(line):
                        first = time.perf_counter() - start
            end = time.perf_counter() - start
            print(f"request {i}: status {response.status_code}, first chunk {_ms(chunk)} ms, first token "
                  f"{_ms(first)} ms, end {_ms(end)} ms", flush=True)


def _speech(client: httpx.Client, args: argparse.Namespace) -> None:
    body = {"model": args.model, "input": "Hello there, this is a first request.", "voice": "tara",
            "response_format": args.speech_format, "max_tokens": args.max_tokens}
    for i in range(args.requests):
        start, first = time.perf_counter(), None
        size = 0
        with client.stream("POST", "/v1/audio/speech", json=body) as response:
            for data in response.iter_bytes():
                if first is None and data:
                    first = time.perf_counter() - start
                size += len(data)
        end = time.perf_counter() - start
        print(f"request {i}: status {response.status_code}, {size} bytes of {args.speech_format}, first byte "
              f"{_ms(first)} ms, end {_ms(end)} ms", flush=True)


if __name__ == "__main__":
    main()
