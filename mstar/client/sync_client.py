"""`MStarClient`: the blocking Python SDK over httpx."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
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


class MStarClient(ClientBase[httpx.Client]):
    """Talks to one mstar server. Every failure, HTTP or in-band in a stream, raises `MStarError`.

    Streaming methods return iterators; leaving the loop early closes the connection.
    """

    http_class = httpx.Client

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MStarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------------

    def _run(self, call: Call | StreamCall) -> Any:
        """The result of a `Call`; for a `StreamCall`, the iterator of its items (sent at the first)."""
        return self._stream(call) if isinstance(call, StreamCall) else self._send(call)

    def _send(self, call: Call) -> Any:
        try:
            resp = self._http.request(call.method, call.path, **call.send)
        except httpx.TransportError as exc:
            raise MStarError(0, f"cannot reach {self._http.base_url}{call.path}: {exc}") from None
        return answer(call, resp)

    def _stream(self, call: StreamCall) -> Iterator[Any]:
        try:
            with self._http.stream("POST", call.path, **call.send) as resp:
                if resp.status_code >= 400:
                    raise error_from_body(resp.status_code, resp.read())
                for line in resp.iter_lines():
                    item = call.item(line)
                    if item is wire.DONE:
                        return
                    if item is not None:
                        yield item
        except httpx.TransportError as exc:
            raise MStarError(0, f"stream from {self._http.base_url}{call.path} broke: {exc}") from None

    def _answers(self, path: str) -> bool:
        try:
            return self._http.get(path).status_code == 200
        except httpx.TransportError:
            return False

    # -- endpoints --------------------------------------------------------------------------------

    def health(self) -> bool:
        """True when the server answers /health."""
        return self._answers("/health")

    def ready(self) -> bool:
        """True when every worker has loaded and warmed up."""
        return self._answers("/ready")

    def models(self) -> ModelList:
        return self._run(endpoints.models())

    def chat(
        self, messages: Any, stream: bool = False, model: str | None = None, **options: Any
    ) -> ChatCompletion | Iterator[ChatCompletionChunk]:
        """Chat completion. `messages` is a prompt string or OpenAI-style messages; `options` are
        request fields (max_tokens, temperature, modalities, model-specific knobs...)."""
        return self._run(endpoints.chat(messages, stream, model or self.model, options))

    def generate(
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
    ) -> GenerateResult | Iterator[OutputChunk | FinalChunk]:
        """Native /generate. `files` are local paths, bytes, (name, bytes) or media dicts; `options`
        are per-request model options. Streaming yields typed chunks, ending with a `FinalChunk`.
        With `multipart`, files travel as multipart file parts instead of base64 inside JSON. Array outputs
        (actions, latents) come as raw bytes (`encoding="binary"`) or JSON numbers (`"json"`), float tensors
        in `tensor_dtype` ("float32" or "bfloat16"); a chunk's `to_numpy()` / `to_torch()` reads either."""
        return self._run(endpoints.generate(text, files, outputs, stream, seed, request_id, multipart,
                                            encoding=encoding, tensor_dtype=tensor_dtype, **options))

    def generate_image(
        self, prompt: str, size: str | None = None, n: int = 1, seed: int | None = None,
        as_bytes: bool = True, **options: Any,
    ):
        """Text to image: PNG bytes (a PIL image with `as_bytes=False`); a list when n > 1."""
        return self._run(endpoints.generate_image(prompt, size, n, seed, as_bytes, self.model, options))

    def tts(
        self, text: str, voice: str | None = None, stream: bool = False, response_format: str = "wav",
        **options: Any,
    ) -> AudioBuffer | Iterator[AudioBuffer]:
        """Text to speech: an `AudioBuffer`, or with `stream` an iterator of `AudioBuffer` pieces."""
        return self._run(endpoints.speech(text, voice, stream, response_format, self.model, options))

    def edit_image(
        self, prompt: str, images: Any, mask: Any = None, size: str | None = None, n: int = 1,
        seed: int | None = None, as_bytes: bool = True, **options: Any,
    ):
        """Image(s) + prompt (+ mask) to image through /v1/images/edits: PNG bytes (a PIL image with
        `as_bytes=False`), a list when n > 1. `images` is a path, bytes, (name, bytes) or a list of them."""
        return self._run(endpoints.edit_image(prompt, images, mask, size, n, seed, as_bytes, self.model, options))

    def transcribe(
        self, audio: Any, prompt: str | None = None, language: str | None = None, response_format: str = "json",
        **options: Any,
    ) -> Any:
        """Audio file (path, bytes or (name, bytes)) to text through /v1/audio/transcriptions: the text
        for json, the parsed object for verbose_json, the body for text, srt and vtt."""
        return self._run(endpoints.transcribe(audio, prompt, language, response_format, self.model, options))

    def generate_video(
        self, prompt: str, seconds: float | None = None, size: str | None = None, input_reference: Any = None,
        poll_interval_s: float = 0.5, timeout_s: float | None = None,
        on_progress: Callable[[int, str], None] | None = None, **options: Any,
    ) -> bytes:
        """Text (or image) to video through the /v1/videos jobs API; returns MP4 bytes.

        Polls every `poll_interval_s`, calling `on_progress(percent, status)` after each poll; a failed
        job or one not done after `timeout_s` raises `MStarError`."""
        job = self._run(endpoints.create_video(prompt, seconds, size, input_reference, self.model, options))
        wait = endpoints.VideoWait(timeout_s, on_progress)
        while not wait.done(job):
            time.sleep(poll_interval_s)
            job = self._run(endpoints.video_job(job["id"]))
        return self._run(endpoints.video_content(job["id"]))

    # -- V-JEPA 2 ---------------------------------------------------------------------------------

    def encode_video(self, video: Any, pooled: bool = False, latent_dtype: str = "float32", as_torch: bool = False,
                     **options: Any) -> Any:
        """V-JEPA 2 latents of `video` (a file, data URL, image frames or uint8 arrays): [tokens, width], or
        their mean [width] with `pooled`. `latent_dtype="bfloat16"` halves the bytes sent (values rounded to
        bfloat16); the result is numpy float32, or with `as_torch` a torch tensor of `latent_dtype`."""
        return self._run(endpoints.encode_video(video, pooled, latent_dtype, as_torch, **options))

    def rollout(self, frames: Any, actions: Any, states: Any, latent_dtype: str = "float32", as_torch: bool = False,
                **options: Any) -> Any:
        """V-JEPA 2-AC: latents [H, patches, width] predicted from context `frames` (one row each of
        `states` [C, 7]) under `actions` [C + H - 1, 7] (one per context frame, then one per further step);
        `latent_dtype` and `as_torch` as for `encode_video`."""
        return self._run(endpoints.rollout(frames, actions, states, latent_dtype, as_torch, **options))

    def plan(
        self, frames: Any, goal: Any, states: Any, actions: Any = (), return_sequence: bool = False, **options: Any,
    ) -> np.ndarray:
        """V-JEPA 2-AC: actions [1, 7] (the whole plan [H, 7] with `return_sequence`) that the cross-entropy
        method finds to move from `frames` (robot `states` [C, 7]; `actions` [C - 1, 7] between them) toward
        the `goal` image; `seed`, `horizon`, `samples`, `topk`, `cem_iterations`, `maxnorm` tune it."""
        return self._run(endpoints.plan(frames, goal, states, actions, return_sequence, **options))

    # -- Cosmos3 policies -------------------------------------------------------------------------

    def predict_actions(self, frames: Any, task: str, with_video: bool = False,
                        **options: Any) -> np.ndarray | tuple[np.ndarray, bytes]:
        """Cosmos3 policy: the action chunk [chunk_size, action width] for `task` from camera `frames` (a
        video file, image files or uint8 arrays; the first frame conditions); with `with_video` also the
        predicted video's MP4 bytes. `embodiment`, `chunk_size`, `seed`, `num_inference_steps` tune it."""
        return self._run(endpoints.predict_actions(frames, task, with_video, **options))
