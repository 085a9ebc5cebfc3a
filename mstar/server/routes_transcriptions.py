"""`POST /v1/audio/transcriptions`: audio file in, text out (json, text, verbose_json, srt, vtt; SSE
with `stream=true`). Served for models that take audio and produce text."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from mstar.server.adapters import RequestError, RequestStream, start_request
from mstar.server.app import ServerState, get_state
from mstar.server.forms import (
    files_of,
    form_options,
    media_bytes,
    read_form,
    refuse_stray_files,
    text_fields,
    validate,
)
from mstar.server.media import decode_audio
from mstar.server.openai_fields import model_options
from mstar.server.openapi import SSE
from mstar.server.protocol_openai_media import TranscriptionRequest
from mstar.server.streaming import ClosingStreamingResponse, guarded, sse, sse_error, unless_disconnected

router = APIRouter()

_FORM_SCHEMA = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file"],
    "properties": {"file": {"type": "string", "format": "binary"}, "model": {"type": "string"},
                   "language": {"type": "string"}, "prompt": {"type": "string"},
                   "response_format": {"type": "string", "enum": ["json", "text", "verbose_json", "srt", "vtt"]},
                   "temperature": {"type": "number"}, "stream": {"type": "boolean"}}}}}}}


_OK = {200: {"content": {"text/plain": {"schema": {"type": "string"}}, "text/vtt": {"schema": {"type": "string"}},
                         "text/event-stream": SSE},
             "description": "JSON (json, verbose_json), text (text, srt), WebVTT (vtt), or SSE with `stream=true`"}}


@router.post("/v1/audio/transcriptions", openapi_extra=_FORM_SCHEMA, response_model=None, responses=_OK)
async def transcriptions(request: Request) -> Response:
    """Transcribe (or, for a generative model, answer) one audio file."""
    state = get_state(request)
    form = await read_form(request)
    refuse_stray_files(form, "/v1/audio/transcriptions", ("file",))
    body = validate(TranscriptionRequest, {k: v for k, v in text_fields(form).items() if k != "file"})
    _check_model(state, body.model)
    options = _options(state, body)
    if body.timestamp_granularities and "word" in body.timestamp_granularities:
        raise RequestError(400, "word timestamps are not supported; ask for 'segment' or leave "
                                "timestamp_granularities out", "timestamp_granularities")
    source = (files_of(form, "file") or [v for v in form.getlist("file") if isinstance(v, str) and v] or [None])[0]
    if source is None:
        raise RequestError(400, "/v1/audio/transcriptions needs the audio as the `file` field", "file")
    data = await media_bytes(source, "file", state.policy("/v1/audio/transcriptions"))
    audio = await run_in_threadpool(decode_audio, data, state.policy("/v1/audio/transcriptions"))
    stream = await start_request(state, _model_request(body, audio), options)
    if body.stream:
        return ClosingStreamingResponse(guarded(lambda: _sse(stream), sse_error), [stream],
                                        media_type="text/event-stream")
    text = await unless_disconnected(request, _text(stream), [stream])
    return _formatted(body, text, audio.duration_s)


def _check_model(state: ServerState, requested: str | None) -> None:
    state.check_model(requested, "text", "/v1/audio/transcriptions")
    if "audio" not in state.runtime.model.input_modalities:
        raise RequestError(404, f"/v1/audio/transcriptions is not available for model {state.model_name!r}: "
                                "it takes no audio input")


def _model_request(body: TranscriptionRequest, audio) -> dict[str, Any]:
    request: dict[str, Any] = {"media": [{"type": "audio", "data": audio.mono(), "sample_rate": audio.sample_rate}]}
    if body.prompt:
        request["text"] = body.prompt
    return request


def _options(state: ServerState, body: TranscriptionRequest) -> dict[str, Any]:
    # `language` is refused unless the model takes it: no model served here reads one
    fields = {name: getattr(body, name) for name in ("language", "temperature") if getattr(body, name) is not None}
    opts = model_options(state, "/v1/audio/transcriptions", body, form_options(body.extra_options()), fields,
                         owned=("modalities",))
    if "modalities" in state.runtime.model.default_options:
        opts["modalities"] = ["text"]
    return opts


async def _text(stream: RequestStream) -> str:
    return "".join([item.value async for item in stream if item.name == "text"])


async def _sse(stream: RequestStream):
    text = ""
    async for item in stream:
        if item.name == "text" and item.value:
            text += item.value
            yield sse({"type": "transcript.text.delta", "delta": item.value})
    yield sse({"type": "transcript.text.done", "text": text})


def _formatted(body: TranscriptionRequest, text: str, duration: float) -> Response:
    fmt = body.response_format
    if fmt == "text":
        return Response(text, media_type="text/plain; charset=utf-8")
    if fmt == "srt":
        return Response(f"1\n{_stamp(0.0, ',')} --> {_stamp(duration, ',')}\n{text}\n",
                        media_type="text/plain; charset=utf-8")
    if fmt == "vtt":
        return Response(f"WEBVTT\n\n{_stamp(0.0, '.')} --> {_stamp(duration, '.')}\n{text}\n",
                        media_type="text/vtt; charset=utf-8")
    if fmt == "verbose_json":
        # One segment spanning the file: models report no alignment, so nothing finer is claimed.
        segment = {"id": 0, "seek": 0, "start": 0.0, "end": duration, "text": text, "tokens": [],
                   "temperature": body.temperature or 0.0, "avg_logprob": 0.0, "compression_ratio": 0.0,
                   "no_speech_prob": 0.0}
        return JSONResponse({"task": "transcribe", "language": body.language or "unknown", "duration": duration,
                             "text": text, "segments": [segment]})
    return JSONResponse({"text": text})


def _stamp(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"
