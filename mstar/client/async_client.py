"""`AsyncMStarClient`: the asyncio twin of `MStarClient` (same methods, awaited).

Streaming methods are awaited first and return async iterators:
`async for chunk in await client.generate(text="hi", stream=True): ...`.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import numpy as np

from mstar.client import wire
from mstar.client.errors import MStarError, error_from_body
from mstar.client.results import AudioBuffer, GenerateResult
from mstar.server.protocol import FinalChunk, GenerateResponse, OutputChunk
from mstar.server.protocol_openai import ChatCompletion, ChatCompletionChunk, ModelList


class AsyncMStarClient:
    """Talks to one mstar server from asyncio code. Every failure raises `MStarError`."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: float = 600.0,
        model: str | None = None,
        http_client: httpx.AsyncClient | None = None,
    ):
        self.model = model
        self._http = http_client or httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=wire.headers(api_key), timeout=httpx.Timeout(timeout, connect=10.0)
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncMStarClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise MStarError(0, f"cannot reach {self._http.base_url}{path}: {exc}") from None
        if resp.status_code >= 400:
            raise error_from_body(resp.status_code, resp.content)
        return resp

    async def _stream_lines(self, path: str, body: dict[str, Any] | None = None, **kwargs: Any
                            ) -> AsyncIterator[str]:
        try:
            async with self._http.stream("POST", path, **({"json": body} if body is not None else kwargs)) as resp:
                if resp.status_code >= 400:
                    raise error_from_body(resp.status_code, await resp.aread())
                async for line in resp.aiter_lines():
                    yield line
        except httpx.TransportError as exc:
            raise MStarError(0, f"stream from {self._http.base_url}{path} broke: {exc}") from None

    async def _sse(self, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        async for line in self._stream_lines(path, body):
            event = wire.sse_event(line)
            if event is wire.DONE:
                return
            if event is not None:
                yield event

    async def health(self) -> bool:
        try:
            return (await self._http.get("/health")).status_code == 200
        except httpx.TransportError:
            return False

    async def ready(self) -> bool:
        try:
            return (await self._http.get("/ready")).status_code == 200
        except httpx.TransportError:
            return False

    async def models(self) -> ModelList:
        return ModelList.model_validate_json((await self._request("GET", "/v1/models")).content)

    async def chat(
        self, messages: Any, stream: bool = False, model: str | None = None, **options: Any
    ) -> ChatCompletion | AsyncIterator[ChatCompletionChunk]:
        """See `MStarClient.chat`."""
        body = {"model": model or self.model, "messages": wire.chat_messages(messages), "stream": stream, **options}
        body = {k: v for k, v in body.items() if v is not None}
        if stream:
            return self._chat_stream(body)
        resp = await self._request("POST", "/v1/chat/completions", json=body)
        return ChatCompletion.model_validate_json(resp.content)

    async def _chat_stream(self, body: dict[str, Any]) -> AsyncIterator[ChatCompletionChunk]:
        async for event in self._sse("/v1/chat/completions", body):
            yield ChatCompletionChunk.model_validate(event)

    async def generate(
        self,
        text: str | None = None,
        files: Any = (),
        outputs: Any = ("text",),
        stream: bool = False,
        seed: int | None = None,
        request_id: str | None = None,
        multipart: bool = False,
        **options: Any,
    ) -> GenerateResult | AsyncIterator[OutputChunk | FinalChunk]:
        """See `MStarClient.generate`."""
        if multipart:
            data, parts = wire.generate_form(text, files, outputs, stream, options, seed, request_id)
            kwargs: dict[str, Any] = {"data": data, "files": parts}
        else:
            kwargs = {"json": wire.generate_body(text, files, outputs, stream, options, seed, request_id)}
        if stream:
            return self._generate_stream(kwargs)
        resp = GenerateResponse.model_validate_json((await self._request("POST", "/generate", **kwargs)).content)
        return GenerateResult(resp.request_id, resp.outputs, resp.finish_reason, resp.usage)

    async def _generate_stream(self, kwargs: dict[str, Any]) -> AsyncIterator[OutputChunk | FinalChunk]:
        async for line in self._stream_lines("/generate", **kwargs):
            chunk = wire.ndjson_chunk(line)
            if chunk is not None:
                yield chunk

    async def generate_image(
        self, prompt: str, size: str | None = None, n: int = 1, seed: int | None = None,
        as_bytes: bool = False, **options: Any,
    ):
        """See `MStarClient.generate_image`."""
        body = {"prompt": prompt, "n": n, "response_format": "b64_json", "model": self.model, "size": size,
                "seed": seed, **options}
        resp = await self._request(
            "POST", "/v1/images/generations", json={k: v for k, v in body.items() if v is not None}
        )
        images = [wire.image_from_b64(d["b64_json"], as_bytes) for d in resp.json()["data"]]
        return images[0] if n == 1 else images

    async def tts(
        self, text: str, voice: str | None = None, stream: bool = False, response_format: str = "wav",
        **options: Any,
    ) -> AudioBuffer | AsyncIterator[AudioBuffer]:
        """See `MStarClient.tts`."""
        body = {"input": text, "voice": voice, "model": self.model, "response_format": response_format, **options}
        body = {k: v for k, v in body.items() if v is not None}
        if stream:
            return self._tts_stream({**body, "response_format": "pcm", "stream_format": "sse"})
        resp = await self._request("POST", "/v1/audio/speech", json=body)
        if response_format == "pcm":
            return AudioBuffer.from_pcm16(resp.content, int(resp.headers.get(wire.SAMPLE_RATE_HEADER, 24000)))
        return AudioBuffer.from_file_bytes(resp.content)

    async def _tts_stream(self, body: dict[str, Any]) -> AsyncIterator[AudioBuffer]:
        async for event in self._sse("/v1/audio/speech", body):
            if event.get("type") == "speech.audio.done":
                return
            if event.get("type") == "speech.audio.delta":
                yield AudioBuffer.from_pcm16(base64.b64decode(event["audio"]), int(event.get("sample_rate") or 24000))

    async def edit_image(
        self, prompt: str, images: Any, mask: Any = None, size: str | None = None, n: int = 1,
        seed: int | None = None, as_bytes: bool = False, **options: Any,
    ):
        """See `MStarClient.edit_image`."""
        data, files = wire.edit_form(prompt, images, mask, {"model": self.model, "size": size, "n": n, "seed": seed,
                                                            **options})
        resp = await self._request("POST", "/v1/images/edits", data=data, files=files)
        out = [wire.image_from_b64(d["b64_json"], as_bytes) for d in resp.json()["data"]]
        return out[0] if n == 1 else out

    async def transcribe(
        self, audio: Any, prompt: str | None = None, language: str | None = None, response_format: str = "json",
        **options: Any,
    ) -> Any:
        """See `MStarClient.transcribe`."""
        fields = wire.form_values({"model": self.model, "prompt": prompt, "language": language,
                                   "response_format": response_format, **options})
        resp = await self._request("POST", "/v1/audio/transcriptions", data=fields,
                                   files=[("file", wire.media_file(audio, "audio"))])
        return wire.transcription_result(resp.content, response_format)

    async def generate_video(
        self, prompt: str, seconds: float | None = None, size: str | None = None, input_reference: Any = None,
        poll_interval_s: float = 0.5, timeout_s: float | None = None,
        on_progress: Callable[[int, str], None] | None = None, **options: Any,
    ) -> bytes:
        """See `MStarClient.generate_video`."""
        body = {"prompt": prompt, "model": self.model, "seconds": seconds, "size": size,
                "input_reference": wire.reference_url(input_reference), **options}
        job = (await self._request("POST", "/v1/videos", json={k: v for k, v in body.items() if v is not None})).json()
        wire.report_progress(job, on_progress)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not wire.check_job(job):
            if deadline is not None and time.monotonic() > deadline:
                raise MStarError(408, f"video job {job['id']} not done after {timeout_s} s (status {job.get('status')})")
            await asyncio.sleep(poll_interval_s)
            job = (await self._request("GET", f"/v1/videos/{job['id']}")).json()
            wire.report_progress(job, on_progress)
        return (await self._request("GET", f"/v1/videos/{job['id']}/content")).content

    # -- V-JEPA 2 ---------------------------------------------------------------------------------

    async def encode_video(self, video: Any, pooled: bool = False, **options: Any) -> np.ndarray:
        """See `MStarClient.encode_video`."""
        name = "pooled" if pooled else "latents"
        return wire.array_output(await self.generate(files=wire.frame_parts(video), outputs=[name], **options), name)

    async def rollout(self, frames: Any, actions: Any, states: Any, **options: Any) -> np.ndarray:
        """See `MStarClient.rollout`."""
        result = await self.generate(
            files=wire.frame_parts(frames), outputs=["predicted"], task="rollout", actions=wire.numbers(actions),
            states=wire.numbers(states), **options)
        return wire.array_output(result, "predicted")

    async def plan(
        self, frames: Any, goal: Any, states: Any, actions: Any = (), return_sequence: bool = False, **options: Any,
    ) -> np.ndarray:
        """See `MStarClient.plan`."""
        result = await self.generate(
            files=wire.frame_parts(frames, goal), outputs=["actions"], task="plan", states=wire.numbers(states),
            actions=wire.numbers(actions), return_sequence=return_sequence, **options)
        return wire.array_output(result, "actions")
