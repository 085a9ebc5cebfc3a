"""`AsyncMStarClient`: the asyncio twin of `MStarClient` (same methods, awaited).

Streaming methods are awaited first and return async iterators:
`async for chunk in await client.generate(text="hi", stream=True): ...`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import numpy as np

from mstar.client import endpoints, wire
from mstar.client.base import ClientBase, answer
from mstar.client.endpoints import Call, StreamCall
from mstar.client.errors import MStarError, error_from_body
from mstar.client.results import AudioBuffer, GenerateResult
from mstar.server.protocol import FinalChunk, OutputChunk
from mstar.server.protocol_openai import ChatCompletion, ChatCompletionChunk, ModelList


class AsyncMStarClient(ClientBase[httpx.AsyncClient]):
    """Talks to one mstar server from asyncio code. Every failure raises `MStarError`."""

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
            raise MStarError(0, f"cannot reach {self._http.base_url}{call.path}: {exc}") from None
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
            raise MStarError(0, f"stream from {self._http.base_url}{call.path} broke: {exc}") from None

    async def _answers(self, path: str) -> bool:
        try:
            return (await self._http.get(path)).status_code == 200
        except httpx.TransportError:
            return False

    async def health(self) -> bool:
        return await self._answers("/health")

    async def ready(self) -> bool:
        return await self._answers("/ready")

    async def models(self) -> ModelList:
        return await self._run(endpoints.models())

    async def chat(
        self, messages: Any, stream: bool = False, model: str | None = None, **options: Any
    ) -> ChatCompletion | AsyncIterator[ChatCompletionChunk]:
        """See `MStarClient.chat`."""
        return await self._run(endpoints.chat(messages, stream, model or self.model, options))

    async def generate(
        self,
        text: str | None = None,
        files: Any = (),
        outputs: Any = ("text",),
        stream: bool = False,
        seed: int | None = None,
        request_id: str | None = None,
        multipart: bool = False,
        *,
        encoding: str = "binary",
        tensor_dtype: str | None = None,
        **options: Any,
    ) -> GenerateResult | AsyncIterator[OutputChunk | FinalChunk]:
        """See `MStarClient.generate`."""
        return await self._run(endpoints.generate(text, files, outputs, stream, seed, request_id, multipart,
                                                  encoding=encoding, tensor_dtype=tensor_dtype, **options))

    async def generate_image(
        self, prompt: str, size: str | None = None, n: int = 1, seed: int | None = None,
        as_bytes: bool = True, **options: Any,
    ):
        """See `MStarClient.generate_image`."""
        return await self._run(endpoints.generate_image(prompt, size, n, seed, as_bytes, self.model, options))

    async def tts(
        self, text: str, voice: str | None = None, stream: bool = False, response_format: str = "wav",
        **options: Any,
    ) -> AudioBuffer | AsyncIterator[AudioBuffer]:
        """See `MStarClient.tts`."""
        return await self._run(endpoints.speech(text, voice, stream, response_format, self.model, options))

    async def edit_image(
        self, prompt: str, images: Any, mask: Any = None, size: str | None = None, n: int = 1,
        seed: int | None = None, as_bytes: bool = True, **options: Any,
    ):
        """See `MStarClient.edit_image`."""
        return await self._run(endpoints.edit_image(prompt, images, mask, size, n, seed, as_bytes, self.model,
                                                    options))

    async def transcribe(
        self, audio: Any, prompt: str | None = None, language: str | None = None, response_format: str = "json",
        **options: Any,
    ) -> Any:
        """See `MStarClient.transcribe`."""
        return await self._run(endpoints.transcribe(audio, prompt, language, response_format, self.model, options))

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

    # -- V-JEPA 2 ---------------------------------------------------------------------------------

    async def encode_video(self, video: Any, pooled: bool = False, latent_dtype: str = "float32",
                           as_torch: bool = False, **options: Any) -> Any:
        """See `MStarClient.encode_video`."""
        return await self._run(endpoints.encode_video(video, pooled, latent_dtype, as_torch, **options))

    async def rollout(self, frames: Any, actions: Any, states: Any, latent_dtype: str = "float32",
                      as_torch: bool = False, **options: Any) -> Any:
        """See `MStarClient.rollout`."""
        return await self._run(endpoints.rollout(frames, actions, states, latent_dtype, as_torch, **options))

    async def plan(
        self, frames: Any, goal: Any, states: Any, actions: Any = (), return_sequence: bool = False, **options: Any,
    ) -> np.ndarray:
        """See `MStarClient.plan`."""
        return await self._run(endpoints.plan(frames, goal, states, actions, return_sequence, **options))

    async def predict_actions(self, frames: Any, task: str, with_video: bool = False,
                              **options: Any) -> np.ndarray | tuple[np.ndarray, bytes]:
        """See `MStarClient.predict_actions`."""
        return await self._run(endpoints.predict_actions(frames, task, with_video, **options))
