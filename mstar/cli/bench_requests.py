"""One benchmark request per workload, timed on the client: what `mstar bench` measures per request."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """Timings of one request, in seconds from when it was sent."""

    ok: bool = False
    error: str | None = None
    first_output_s: float | None = None
    """time to the first token (chat) or the first audio byte (speech)"""
    e2e_s: float = 0.0
    """time to the end of the response"""
    output_tokens: int = 0
    """completion tokens: the server's `usage` if it sent one, else the number of content chunks"""
    gaps_s: list[float] = field(default_factory=list)
    """times between consecutive content chunks (inter-token latency)"""
    audio_bytes: int = 0


def chat_body(model: str, prompt: str, max_tokens: int, ignore_eos: bool, extra: dict[str, Any]) -> dict:
    """The streamed /v1/chat/completions body; `ignore_eos` is passed through for servers that honour it."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    return {**body, **extra}


def speech_body(model: str, text: str, voice: str | None, extra: dict[str, Any], max_tokens: int | None = None,
                ignore_eos: bool = False) -> dict:
    """The /v1/audio/speech body asking for raw 16-bit PCM streamed as it is made; `max_tokens` and
    `ignore_eos` go as model options (a TTS model counts its audio tokens)."""
    body: dict[str, Any] = {"model": model, "input": text, "response_format": "pcm", "stream_format": "audio"}
    if voice:
        body["voice"] = voice
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if ignore_eos:
        body["ignore_eos"] = True
    return {**body, **extra}


def _chunk_has_output(chunk: dict) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False


async def _fail(response, record: RequestRecord) -> RequestRecord:
    body = (await response.aread())[:200].decode("utf-8", "replace")
    record.error = f"HTTP {response.status_code}: {body}"
    return record


async def run_chat(client, body: dict) -> RequestRecord:
    """POST a streamed chat completion; read SSE `data:` lines until `[DONE]`."""
    record, start = RequestRecord(), time.perf_counter()
    last, chunks, usage_tokens = None, 0, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return await _fail(response, record)
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                record.error = f"in-band error: {chunk['error']}"
                return record
            if (chunk.get("usage") or {}).get("completion_tokens") is not None:
                usage_tokens = chunk["usage"]["completion_tokens"]
            if _chunk_has_output(chunk):
                now = time.perf_counter() - start
                if last is None:
                    record.first_output_s = now
                else:
                    record.gaps_s.append(now - last)
                last, chunks = now, chunks + 1
    record.e2e_s = time.perf_counter() - start
    record.output_tokens = usage_tokens if usage_tokens is not None else chunks
    record.ok = True
    return record


async def run_speech(client, body: dict) -> RequestRecord:
    """POST a speech request and stream its PCM bytes; gaps are between received byte chunks."""
    record, start, last = RequestRecord(), time.perf_counter(), None
    async with client.stream("POST", "/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            return await _fail(response, record)
        async for data in response.aiter_raw():
            if not data:
                continue
            now = time.perf_counter() - start
            if last is None:
                record.first_output_s = now
            else:
                record.gaps_s.append(now - last)
            last = now
            record.audio_bytes += len(data)
    record.e2e_s = time.perf_counter() - start
    record.ok = True
    return record
