"""The SDK's endpoints as I/O-free calls: the request each client method makes and how its answer
becomes the method's result. `MStarClient` and `AsyncMStarClient` only send them."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import httpx
import numpy as np

from mstar.client import wire
from mstar.client.errors import MStarError
from mstar.client.results import AudioBuffer, GenerateResult
from mstar.server.protocol import GenerateResponse
from mstar.server.protocol_openai import ChatCompletion, ChatCompletionChunk, ModelList

SPEECH_RATE = 24000  # the sample rate of speech whose answer does not state one


@dataclass(frozen=True)
class Call:
    """One request, answered in one body that `read` turns into the result."""

    method: str
    path: str
    send: dict[str, Any] = field(default_factory=dict)  # httpx's json=, data= and files= arguments
    read: Callable[[httpx.Response], Any] = httpx.Response.json


@dataclass(frozen=True)
class StreamCall:
    """A POST answered line by line: `item` turns a line into what the stream yields, None to skip
    it, or `wire.DONE` to end the stream."""

    path: str
    send: dict[str, Any]
    item: Callable[[str], Any]


def client_settings(base_url: str, api_key: str | None, timeout: float) -> dict[str, Any]:
    """The httpx client's arguments: the server's base URL, the bearer key and the timeouts."""
    return {"base_url": base_url.rstrip("/"), "headers": wire.headers(api_key),
            "timeout": httpx.Timeout(timeout, connect=10.0)}


def _present(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields that are not None (the server applies its defaults to the rest)."""
    return {k: v for k, v in fields.items() if v is not None}


def models() -> Call:
    return Call("GET", "/v1/models", read=lambda resp: ModelList.model_validate_json(resp.content))


def chat(messages: Any, stream: bool, model: str | None, options: dict[str, Any]) -> Call | StreamCall:
    body = _present({"model": model, "messages": wire.chat_messages(messages), "stream": stream, **options})
    if stream:
        return StreamCall("/v1/chat/completions", {"json": body}, _chat_chunk)
    return Call("POST", "/v1/chat/completions", {"json": body},
                lambda resp: ChatCompletion.model_validate_json(resp.content))


def _chat_chunk(line: str) -> Any:
    event = wire.sse_event(line)
    return event if event is None or event is wire.DONE else ChatCompletionChunk.model_validate(event)


def generate(text: str | None = None, files: Any = (), outputs: Any = ("text",), stream: bool = False,
             seed: int | None = None, request_id: str | None = None, multipart: bool = False, *,
             encoding: str = "binary", tensor_dtype: str | None = None, **options: Any) -> Call | StreamCall:
    """Native /generate: JSON with base64 media, or with `multipart` the files as file parts; array outputs
    come as `encoding` asks (raw bytes by default), float tensors in `tensor_dtype`."""
    arrays = wire.array_fields(encoding, tensor_dtype)
    if multipart:
        data, parts = wire.generate_form(text, files, outputs, stream, options, seed, request_id, arrays)
        send: dict[str, Any] = {"data": data, "files": parts}
    else:
        send = {"json": wire.generate_body(text, files, outputs, stream, options, seed, request_id, arrays)}
    if stream:
        return StreamCall("/generate", send, wire.ndjson_chunk)
    return Call("POST", "/generate", send, _generate_result)


def _generate_result(resp: httpx.Response) -> GenerateResult:
    answer = GenerateResponse.model_validate_json(resp.content)
    return GenerateResult(answer.request_id, answer.outputs, answer.finish_reason, answer.usage)


def generate_image(prompt: str, size: str | None, n: int, seed: int | None, as_bytes: bool, model: str | None,
                   options: dict[str, Any]) -> Call:
    body = _present({"prompt": prompt, "n": n, "response_format": "b64_json", "model": model, "size": size,
                     "seed": seed, **options})
    return Call("POST", "/v1/images/generations", {"json": body}, partial(_images, n=n, as_bytes=as_bytes))


def edit_image(prompt: str, images: Any, mask: Any, size: str | None, n: int, seed: int | None, as_bytes: bool,
               model: str | None, options: dict[str, Any]) -> Call:
    data, files = wire.edit_form(prompt, images, mask, {"model": model, "size": size, "n": n, "seed": seed,
                                                        **options})
    return Call("POST", "/v1/images/edits", {"data": data, "files": files}, partial(_images, n=n, as_bytes=as_bytes))


def _images(resp: httpx.Response, n: int, as_bytes: bool) -> Any:
    """PNG bytes (PIL images without `as_bytes`) of an images answer; the image itself when n is 1."""
    images = [wire.image_from_b64(d["b64_json"], as_bytes) for d in resp.json()["data"]]
    return images[0] if n == 1 else images


def speech(text: str, voice: str | None, stream: bool, response_format: str, model: str | None,
           options: dict[str, Any]) -> Call | StreamCall:
    body = _present({"input": text, "voice": voice, "model": model, "response_format": response_format, **options})
    if stream:
        return StreamCall("/v1/audio/speech", {"json": {**body, "response_format": "pcm", "stream_format": "sse"}},
                          _speech_piece)
    return Call("POST", "/v1/audio/speech", {"json": body}, partial(_speech, pcm=response_format == "pcm"))


def _speech(resp: httpx.Response, pcm: bool) -> AudioBuffer:
    if pcm:
        return AudioBuffer.from_pcm16(resp.content, int(resp.headers.get(wire.SAMPLE_RATE_HEADER, SPEECH_RATE)))
    return AudioBuffer.from_file_bytes(resp.content)


def _speech_piece(line: str) -> Any:
    event = wire.sse_event(line)
    if event is None or event is wire.DONE:
        return event
    if event.get("type") == "speech.audio.done":
        return wire.DONE
    if event.get("type") == "speech.audio.delta":
        return AudioBuffer.from_pcm16(base64.b64decode(event["audio"]), int(event.get("sample_rate") or SPEECH_RATE))
    return None


def transcribe(audio: Any, prompt: str | None, language: str | None, response_format: str, model: str | None,
               options: dict[str, Any]) -> Call:
    fields = wire.form_values({"model": model, "prompt": prompt, "language": language,
                               "response_format": response_format, **options})
    return Call("POST", "/v1/audio/transcriptions", {"data": fields, "files": [("file", wire.media_file(audio, "audio"))]},
                lambda resp: wire.transcription_result(resp.content, response_format))


def create_video(prompt: str, seconds: float | None, size: str | None, input_reference: Any, model: str | None,
                 options: dict[str, Any]) -> Call:
    """Starts a /v1/videos job; the result is the job object."""
    body = _present({"prompt": prompt, "model": model, "seconds": seconds, "size": size,
                     "input_reference": wire.reference_url(input_reference), **options})
    return Call("POST", "/v1/videos", {"json": body})


def video_job(job_id: str) -> Call:
    return Call("GET", f"/v1/videos/{job_id}")


def video_content(job_id: str) -> Call:
    return Call("GET", f"/v1/videos/{job_id}/content", read=lambda resp: resp.content)


class VideoWait:
    """Decides, poll after poll, whether a video job is done: reports each state to `on_progress`
    and raises `MStarError` for a failed job or one not done after `timeout_s`."""

    def __init__(self, timeout_s: float | None, on_progress: Callable[[int, str], None] | None):
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.on_progress = on_progress

    def done(self, job: dict[str, Any]) -> bool:
        wire.report_progress(job, self.on_progress)
        if wire.check_job(job):
            return True
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise MStarError(408, f"video job {job['id']} not done after {self.timeout_s} s (status {job.get('status')})")
        return False


# -- V-JEPA 2: /generate calls whose result is one output's array ----------------------------------


def encode_video(video: Any, pooled: bool, latent_dtype: str = "float32", as_torch: bool = False,
                 **options: Any) -> Call:
    name = "pooled" if pooled else "latents"
    call = generate(files=wire.frame_parts(video), outputs=[name], tensor_dtype=latent_dtype, **options)
    return _array(call, name, as_torch)


def rollout(frames: Any, actions: Any, states: Any, latent_dtype: str = "float32", as_torch: bool = False,
            **options: Any) -> Call:
    call = generate(files=wire.frame_parts(frames), outputs=["predicted"], task="rollout",
                    actions=wire.numbers(actions), states=wire.numbers(states), tensor_dtype=latent_dtype, **options)
    return _array(call, "predicted", as_torch)


def plan(frames: Any, goal: Any, states: Any, actions: Any, return_sequence: bool, **options: Any) -> Call:
    call = generate(files=wire.frame_parts(frames, goal), outputs=["actions"], task="plan",
                    states=wire.numbers(states), actions=wire.numbers(actions), return_sequence=return_sequence,
                    **options)
    return _array(call, "actions")


# -- Cosmos3 policies: /generate answering an action chunk ------------------------------------------


def predict_actions(frames: Any, task: str, with_video: bool, **options: Any) -> Call:
    outputs = ["actions", "video"] if with_video else ["actions"]
    call = generate(text=task, files=wire.frame_parts(frames), outputs=outputs, modalities=outputs, **options)
    if not with_video:
        return _array(call, "actions")
    return replace(call, read=lambda resp: _actions_and_video(_generate_result(resp)))


def _actions_and_video(result: Any) -> tuple[np.ndarray, bytes]:
    videos = result.outputs.get("video")
    if not videos:
        raise MStarError(502, f"the server sent no 'video' output (got {sorted(result.outputs)})")
    return wire.array_output(result, "actions"), videos[-1].mp4_bytes()


def _array(call: Call | StreamCall, name: str, as_torch: bool = False) -> Call:
    """`call`, a /generate call, reading the array of its output `name` (numpy, or torch with `as_torch`)."""
    if not isinstance(call, Call):
        raise ValueError(f"output {name!r} is an array read from the whole answer; drop stream=True")
    return replace(call, read=lambda resp: wire.array_output(_generate_result(resp), name, as_torch))
