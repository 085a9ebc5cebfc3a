"""What `MStarClient` and `AsyncMStarClient` share: their settings, the httpx client they hold, every
endpoint method (written once over `_run`), and how a sent call's answer becomes its result or an
`MStarError`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

import httpx

from mstar.client import endpoints
from mstar.client.endpoints import Call, StreamCall
from mstar.client.errors import error_from_body

HttpT = TypeVar("HttpT", httpx.Client, httpx.AsyncClient)


class ClientBase(ABC, Generic[HttpT]):
    """The default model, the httpx client (built from the server's URL, key and timeout unless given) and
    the endpoint methods. Each method returns what `_run` returns: the result itself on the blocking client,
    an awaitable of it on the asyncio one, so `await client.chat(...)` there; results named below are the
    awaited ones. Streams are iterators (async iterators on the asyncio client)."""

    http_class: ClassVar[Callable[..., Any]]  # httpx.Client or httpx.AsyncClient

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: float = 600.0,
        model: str | None = None,
        http_client: HttpT | None = None,
    ):
        self.model = model
        self._http: HttpT = http_client or self.http_class(**endpoints.client_settings(base_url, api_key, timeout))

    @abstractmethod
    def _run(self, call: Call | StreamCall) -> Any:
        """The result of a `Call`; for a `StreamCall`, the iterator of its items (sent at the first)."""

    @abstractmethod
    def _answers(self, path: str) -> Any:
        """True when GET `path` answers 200; False for any other status or no answer."""

    # -- endpoints --------------------------------------------------------------------------------

    def health(self) -> Any:
        """True when the server answers /health."""
        return self._answers("/health")

    def ready(self) -> Any:
        """True when every worker has loaded and warmed up."""
        return self._answers("/ready")

    def models(self) -> Any:
        """The served models, a `ModelList`."""
        return self._run(endpoints.models())

    def chat(self, messages: Any, stream: bool = False, model: str | None = None, **options: Any) -> Any:
        """Chat completion: a `ChatCompletion`, or with `stream` an iterator of `ChatCompletionChunk`.
        `messages` is a prompt string or OpenAI-style messages; `options` are request fields (max_tokens,
        temperature, modalities, model-specific knobs...)."""
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
    ) -> Any:
        """Native /generate: a `GenerateResult`, or with `stream` an iterator of typed chunks (`OutputChunk`),
        ending with a `FinalChunk`. `files` are local paths, bytes, (name, bytes) or media dicts; `options`
        are per-request model options. With `multipart`, files travel as multipart file parts instead of
        base64 inside JSON. Array outputs (actions, latents) come as raw bytes (`encoding="binary"`) or JSON
        numbers (`"json"`), float tensors in `tensor_dtype` ("float32" or "bfloat16"); a chunk's
        `to_numpy()` / `to_torch()` reads either."""
        return self._run(endpoints.generate(text, files, outputs, stream, seed, request_id, multipart,
                                            encoding=encoding, tensor_dtype=tensor_dtype, **options))

    def generate_image(
        self, prompt: str, size: str | None = None, n: int = 1, seed: int | None = None,
        as_bytes: bool = True, **options: Any,
    ) -> Any:
        """Text to image: PNG bytes (a PIL image with `as_bytes=False`); a list when n > 1."""
        return self._run(endpoints.generate_image(prompt, size, n, seed, as_bytes, self.model, options))

    def tts(
        self, text: str, voice: str | None = None, stream: bool = False, response_format: str = "wav",
        **options: Any,
    ) -> Any:
        """Text to speech: an `AudioBuffer`, or with `stream` an iterator of `AudioBuffer` pieces."""
        return self._run(endpoints.speech(text, voice, stream, response_format, self.model, options))

    def edit_image(
        self, prompt: str, images: Any, mask: Any = None, size: str | None = None, n: int = 1,
        seed: int | None = None, as_bytes: bool = True, **options: Any,
    ) -> Any:
        """Image(s) + prompt (+ mask) to image through /v1/images/edits: PNG bytes (a PIL image with
        `as_bytes=False`), a list when n > 1. `images` is a path, bytes, (name, bytes) or a list of them."""
        return self._run(endpoints.edit_image(prompt, images, mask, size, n, seed, as_bytes, self.model, options))

    def transcribe(
        self, audio: Any, prompt: str | None = None, language: str | None = None, response_format: str = "json",
        **options: Any,
    ) -> Any:
        """Audio file (path, bytes or (name, bytes)) to text through /v1/audio/transcriptions: the text
        for json, the parsed object for verbose_json, the body for text, srt and vtt. A `language` is a 400
        from a model that takes none (no model served today reads one)."""
        return self._run(endpoints.transcribe(audio, prompt, language, response_format, self.model, options))

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
    ) -> Any:
        """V-JEPA 2-AC: a numpy array of actions [1, 7] (the whole plan [H, 7] with `return_sequence`) that the
        cross-entropy method finds to move from `frames` (robot `states` [C, 7]; `actions` [C - 1, 7] between
        them) toward the `goal` image; `seed`, `horizon`, `samples`, `topk`, `cem_iterations`, `maxnorm`
        tune it."""
        return self._run(endpoints.plan(frames, goal, states, actions, return_sequence, **options))

    # -- Cosmos3 policies -------------------------------------------------------------------------

    def predict_actions(self, frames: Any, task: str, with_video: bool = False, **options: Any) -> Any:
        """Cosmos3 policy: the action chunk [chunk_size, action width] (numpy) for `task` from camera `frames`
        (a video file, image files or uint8 arrays; the first frame conditions); with `with_video` also the
        predicted video's MP4 bytes. `embodiment`, `chunk_size`, `seed`, `num_inference_steps` tune it."""
        return self._run(endpoints.predict_actions(frames, task, with_video, **options))


def answer(call: Call, resp: httpx.Response) -> Any:
    """`call`'s result read from `resp`; an HTTP error status raises `MStarError` with the server's message."""
    if resp.status_code >= 400:
        raise error_from_body(resp.status_code, resp.content)
    return call.read(resp)
