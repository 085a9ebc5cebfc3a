"""`AsyncMStarClient`: the asyncio twin of `MStarClient` (same methods, awaited).

Streaming methods are awaited first and return async iterators:
`async for chunk in await client.generate(text="hi", stream=True): ...`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from mstar.client import endpoints, wire
from mstar.client.base import ClientBase, answer
from mstar.client.endpoints import Call, StreamCall
from mstar.client.errors import error_from_body, transport_error


class AsyncMStarClient(ClientBase[httpx.AsyncClient]):
    """Talks to one mstar server from asyncio code. Every failure raises `MStarError`.

    The endpoint methods are `ClientBase`'s; here they return awaitables, since `_run` is a coroutine.
    """

    http_class = httpx.AsyncClient

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncMStarClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self, call: Call | StreamCall) -> Any:
        """The result of a `Call`; for a `StreamCall`, the async iterator of its items (not yet started)."""
        return self._stream(call) if isinstance(call, StreamCall) else await self._send(call)

    async def _send(self, call: Call) -> Any:
        try:
            resp = await self._http.request(call.method, call.path, **call.send)
        except httpx.TransportError as exc:
            raise transport_error(exc, f"{self._http.base_url}{call.path}", False, self._http.timeout.read) from None
        return answer(call, resp)

    async def _stream(self, call: StreamCall) -> AsyncIterator[Any]:
        try:
            async with self._http.stream("POST", call.path, **call.send) as resp:
                if resp.status_code >= 400:
                    raise error_from_body(resp.status_code, await resp.aread())
                async for line in resp.aiter_lines():
                    item = call.item(line)
                    if item is wire.DONE:
                        return
                    if item is not None:
                        yield item
        except httpx.TransportError as exc:
            raise transport_error(exc, f"{self._http.base_url}{call.path}", True, self._http.timeout.read) from None

    async def _answers(self, path: str) -> bool:
        try:
            return (await self._http.get(path)).status_code == 200
        except httpx.TransportError:
            return False

    async def generate_video(
        self, prompt: str, seconds: float | None = None, size: str | None = None, input_reference: Any = None,
        poll_interval_s: float = 0.5, timeout_s: float | None = None,
        on_progress: Callable[[int, str], None] | None = None, **options: Any,
    ) -> bytes:
        """See `MStarClient.generate_video`."""
        job = await self._run(endpoints.create_video(prompt, seconds, size, input_reference, self.model, options))
        wait = endpoints.VideoWait(timeout_s, on_progress)
        while not wait.done(job):
            await asyncio.sleep(poll_interval_s)
            job = await self._run(endpoints.video_job(job["id"]))
        return await self._run(endpoints.video_content(job["id"]))
