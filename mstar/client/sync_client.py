"""`MStarClient`: the blocking Python SDK over httpx."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np

from mstar.client import wire
from mstar.client.errors import MStarError, error_from_body
from mstar.client.results import AudioBuffer, GenerateResult
from mstar.server.protocol import FinalChunk, GenerateResponse, OutputChunk
from mstar.server.protocol_openai import ChatCompletion, ChatCompletionChunk, ModelList


class MStarClient:
    """Talks to one mstar server. Every failure, HTTP or in-band in a stream, raises `MStarError`.

    Streaming methods return iterators; leaving the loop early closes the connection.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: float = 600.0,
        model: str | None = None,
        http_client: httpx.Client | None = None,
    ):
        self.model = model
        self._http = http_client or httpx.Client(
            base_url=base_url.rstrip("/"), headers=wire.headers(api_key), timeout=httpx.Timeout(timeout, connect=10.0)
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MStarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise MStarError(0, f"cannot reach {self._http.base_url}{path}: {exc}") from None
        if resp.status_code >= 400:
            raise error_from_body(resp.status_code, resp.content)
        return resp

    def _stream_lines(self, path: str, body: dict[str, Any] | None = None, **kwargs: Any) -> Iterator[str]:
        try:
            with self._http.stream("POST", path, **({"json": body} if body is not None else kwargs)) as resp:
                if resp.status_code >= 400:
                    raise error_from_body(resp.status_code, resp.read())
                yield from resp.iter_lines()
        except httpx.TransportError as exc:
            raise MStarError(0, f"stream from {self._http.base_url}{path} broke: {exc}") from None

    def _sse(self, path: str, body: dict[str, Any]) -> Iterator[Any]:
        for line in self._stream_lines(path, body):
            event = wire.sse_event(line)
            if event is wire.DONE:
                return
            if event is not None:
                yield event

    # -- endpoints --------------------------------------------------------------------------------

    def health(self) -> bool:
        """True when the server answers /health."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def ready(self) -> bool:
        """True when every worker has loaded and warmed up."""
        try:
            return self._http.get("/ready").status_code == 200
        except httpx.TransportError:
            return False

    def models(self) -> ModelList:
        return ModelList.model_validate_json(self._request("GET", "/v1/models").content)

    def chat(
        self, messages: Any, stream: bool = False, model: str | None = None, **options: Any
    ) -> ChatCompletion | Iterator[ChatCompletionChunk]:
        """Chat completion. `messages` is a prompt string or OpenAI-style messages; `options` are
        request fields (max_tokens, temperature, modalities, model-specific knobs...)."""
        body = {"model": model or self.model, "messages": wire.chat_messages(messages), "stream": stream, **options}
        body = {k: v for k, v in body.items() if v is not None}
        if stream:
            return (ChatCompletionChunk.model_validate(e) for e in self._sse("/v1/chat/completions", body))
        return ChatCompletion.model_validate_json(self._request("POST", "/v1/chat/completions", json=body).content)

    def generate(
        self,
        text: str | None = None,
        files: Any = (),
        outputs: Any = ("text",),
        stream: bool = False,
        seed: int | None = None,
        request_id: str | None = None,
        multipart: bool = False,
        **options: Any,
    ) -> GenerateResult | Iterator[OutputChunk | FinalChunk]:
        """Native /generate. `files` are local paths, bytes, (name, bytes) or media dicts; `options`
        are per-request model options. Streaming yields typed chunks, ending with a `FinalChunk`.
        With `multipart`, files travel as multipart file parts instead of base64 inside JSON."""
        if multipart:
            data, parts = wire.generate_form(text, files, outputs, stream, options, seed, request_id)
            kwargs: dict[str, Any] = {"data": data, "files": parts}
        else:
            kwargs = {"json": wire.generate_body(text, files, outputs, stream, options, seed, request_id)}
        if stream:
            return self._generate_stream(kwargs)
        resp = GenerateResponse.model_validate_json(self._request("POST", "/generate", **kwargs).content)
        return GenerateResult(resp.request_id, resp.outputs, resp.finish_reason, resp.usage)

    def _generate_stream(self, kwargs: dict[str, Any]) -> Iterator[OutputChunk | FinalChunk]:
        for line in self._stream_lines("/generate", **kwargs):
            chunk = wire.ndjson_chunk(line)
            if chunk is not None:
                yield chunk

    def generate_image(
        self, prompt: str, size: str | None = None, n: int = 1, seed: int | None = None,
        as_bytes: bool = False, **options: Any,
    ):
        """Text to image: a PIL image (or PNG bytes with `as_bytes`); a list when n > 1."""
        body = {"prompt": prompt, "n": n, "response_format": "b64_json", "model": self.model, "size": size,
                "seed": seed, **options}
        data = self._request("POST", "/v1/images/generations", json={k: v for k, v in body.items() if v is not None})
        images = [wire.image_from_b64(d["b64_json"], as_bytes) for d in data.json()["data"]]
        return images[0] if n == 1 else images

    def tts(
        self, text: str, voice: str | None = None, stream: bool = False, response_format: str = "wav",
        **options: Any,
    ) -> AudioBuffer | Iterator[AudioBuffer]:
        """Text to speech: an `AudioBuffer`, or with `stream` an iterator of `AudioBuffer` pieces."""
        body = {"input": text, "voice": voice, "model": self.model, "response_format": response_format, **options}
        body = {k: v for k, v in body.items() if v is not None}
        if stream:
            return self._tts_stream({**body, "response_format": "pcm", "stream_format": "sse"})
        resp = self._request("POST", "/v1/audio/speech", json=body)
        if response_format == "pcm":
            return AudioBuffer.from_pcm16(resp.content, int(resp.headers.get(wire.SAMPLE_RATE_HEADER, 24000)))
        return AudioBuffer.from_file_bytes(resp.content)

    def _tts_stream(self, body: dict[str, Any]) -> Iterator[AudioBuffer]:
        import base64

        for event in self._sse("/v1/audio/speech", body):
            if event.get("type") == "speech.audio.done":
                return
            if event.get("type") == "speech.audio.delta":
                yield AudioBuffer.from_pcm16(base64.b64decode(event["audio"]), int(event.get("sample_rate") or 24000))

    def edit_image(
        self, prompt: str, images: Any, mask: Any = None, size: str | None = None, n: int = 1,
        seed: int | None = None, as_bytes: bool = False, **options: Any,
    ):
        """Image(s) + prompt (+ mask) to image through /v1/images/edits: a PIL image (PNG bytes with
        `as_bytes`), a list when n > 1. `images` is a path, bytes, (name, bytes) or a list of them."""
        data, files = wire.edit_form(prompt, images, mask, {"model": self.model, "size": size, "n": n, "seed": seed,
                                                            **options})
        resp = self._request("POST", "/v1/images/edits", data=data, files=files)
        out = [wire.image_from_b64(d["b64_json"], as_bytes) for d in resp.json()["data"]]
        return out[0] if n == 1 else out

    def transcribe(
        self, audio: Any, prompt: str | None = None, language: str | None = None, response_format: str = "json",
        **options: Any,
    ) -> Any:
        """Audio file (path, bytes or (name, bytes)) to text through /v1/audio/transcriptions: the text
        for json, the parsed object for verbose_json, the body for text, srt and vtt."""
        fields = wire.form_values({"model": self.model, "prompt": prompt, "language": language,
                                   "response_format": response_format, **options})
        resp = self._request("POST", "/v1/audio/transcriptions", data=fields,
                             files=[("file", wire.media_file(audio, "audio"))])
        return wire.transcription_result(resp.content, response_format)

    def generate_video(
        self, prompt: str, seconds: float | None = None, size: str | None = None, input_reference: Any = None,
        poll_interval_s: float = 0.5, timeout_s: float | None = None,
        on_progress: Callable[[int, str], None] | None = None, **options: Any,
    ) -> bytes:
        """Text (or image) to video through the /v1/videos jobs API; returns MP4 bytes.

        Polls every `poll_interval_s`, calling `on_progress(percent, status)` after each poll; a failed
        job or one not done after `timeout_s` raises `MStarError`."""
        body = {"prompt": prompt, "model": self.model, "seconds": seconds, "size": size,
                "input_reference": wire.reference_url(input_reference), **options}
        job = self._request("POST", "/v1/videos", json={k: v for k, v in body.items() if v is not None}).json()
        wire.report_progress(job, on_progress)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not wire.check_job(job):
            if deadline is not None and time.monotonic() > deadline:
                raise MStarError(408, f"video job {job['id']} not done after {timeout_s} s (status {job.get('status')})")
            time.sleep(poll_interval_s)
            job = self._request("GET", f"/v1/videos/{job['id']}").json()
            wire.report_progress(job, on_progress)
        return self._request("GET", f"/v1/videos/{job['id']}/content").content

    # -- V-JEPA 2 ---------------------------------------------------------------------------------

    def encode_video(self, video: Any, pooled: bool = False, **options: Any) -> np.ndarray:
        """V-JEPA 2 latents of `video` (a file, data URL, image frames or uint8 arrays): [tokens, width], or
        their mean [width] with `pooled`."""
        name = "pooled" if pooled else "latents"
        return wire.array_output(self.generate(files=wire.frame_parts(video), outputs=[name], **options), name)

    def rollout(self, frames: Any, actions: Any, states: Any, **options: Any) -> np.ndarray:
        """V-JEPA 2-AC: latents [H, patches, width] predicted from context `frames` (one row each of
        `states` [C, 7]) under `actions` [C + H - 1, 7] (one per context frame, then one per further step)."""
        result = self.generate(
            files=wire.frame_parts(frames), outputs=["predicted"], task="rollout", actions=wire.numbers(actions),
            states=wire.numbers(states), **options)
        return wire.array_output(result, "predicted")

    def plan(
        self, frames: Any, goal: Any, states: Any, actions: Any = (), return_sequence: bool = False, **options: Any,
    ) -> np.ndarray:
        """V-JEPA 2-AC: actions [1, 7] (the whole plan [H, 7] with `return_sequence`) that the cross-entropy
        method finds to move from `frames` (robot `states` [C, 7]; `actions` [C - 1, 7] between them) toward
        the `goal` image; `seed`, `horizon`, `samples`, `topk`, `cem_iterations`, `maxnorm` tune it."""
        result = self.generate(
            files=wire.frame_parts(frames, goal), outputs=["actions"], task="plan", states=wire.numbers(states),
            actions=wire.numbers(actions), return_sequence=return_sequence, **options)
        return wire.array_output(result, "actions")
