"""Response helpers that tie a request's lifetime to the client connection."""

from __future__ import annotations

import asyncio
import json
import random
import string
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse

from mstar.server.adapters import RequestError, RequestStream
from mstar.server.protocol import error_response, one_line

T = TypeVar("T")


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its request streams however the response ends: a client
    disconnect cancels the task mid-send, and an abandoned generator's `finally` may run late."""

    def __init__(self, content, streams: list[RequestStream], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self.streams:
                stream.close()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T], streams: list[RequestStream]) -> T:
    """Await `work`; if the client disconnects first, cancel it and the streams, raise RequestError(499)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            for stream in streams:
                stream.close()
    if not task.done() or task.cancelled():
        raise RequestError(499, "client disconnected")
    return task.result()


def sse(payload: Any, pad_to: int = 0) -> bytes:
    """One server-sent event carrying JSON (a pydantic model or a plain object); with `pad_to`, the JSON object
    gains an `obfuscation` string that makes its length a multiple of `pad_to` bytes."""
    text = payload.model_dump_json(exclude_none=True) if hasattr(payload, "model_dump_json") else json.dumps(payload)
    data = one_line(text)
    if pad_to:
        data = _padded(data, pad_to)
    return b"data: " + data + b"\n\n"


def _padded(data: bytes, block: int) -> bytes:
    assert data.startswith(b"{") and data.endswith(b"}") and data != b"{}", "only a non-empty object is padded"
    fill = -(len(data) + len(b',"obfuscation":""')) % block
    # letters, not spaces: a proxy that compresses the stream would squeeze spaces back out
    letters = "".join(random.choices(string.ascii_letters + string.digits, k=fill))
    return data[:-1] + b',"obfuscation":"' + letters.encode() + b'"}'


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(exc: RequestError) -> bytes:
    """The in-band error event of a stream that already started: `data: {"error": {...}}`."""
    return sse(error_response(exc.status, exc.message, exc.param))


async def guarded(gen_factory: Callable[[], Any], on_error: Callable[[RequestError], bytes]):
    """Run an async generator of bytes; a RequestError inside becomes one in-band error chunk."""
    try:
        async for chunk in gen_factory():
            yield chunk
    except RequestError as exc:
        yield on_error(exc)
