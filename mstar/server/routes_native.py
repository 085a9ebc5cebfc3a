"""Native routes: `POST /generate` (NDJSON stream or one JSON answer), /health, /ready, /metrics."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from mstar.server.adapters import Item, RequestError, RequestStream, start_request
from mstar.server.app import error_json, get_state
from mstar.server.media import decode_audio, decode_image, decode_video, encode_image, encode_video
from mstar.server.protocol import (
    AudioChunk,
    ErrorChunk,
    ErrorResponse,
    FinalChunk,
    GenerateRequest,
    GenerateResponse,
    ImageChunk,
    TensorChunk,
    TextChunk,
    VideoChunk,
    chunk_line,
)
from mstar.server.streaming import ClosingStreamingResponse, guarded, unless_disconnected

router = APIRouter()
VIDEO_FPS = 8.0  # frame rate given to video outputs whose model does not say


@router.get("/health")
async def health() -> dict[str, str]:
    """The process is up (no key needed)."""
    return {"status": "ok"}


_ERROR = {"model": ErrorResponse}
_NDJSON = {"application/x-ndjson": {"schema": {"type": "string", "description": "one JSON chunk per line"}}}


@router.get("/ready", responses={503: {**_ERROR, "description": "still loading, or stopping"}})
async def ready(request: Request) -> Response:
    """200 once every worker is loaded; 503 before (and while shutting down)."""
    if get_state(request).runtime.ready:
        return JSONResponse({"status": "ready"})
    return error_json(503, "the model is still loading (or the server is stopping)")


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    """Prometheus exposition text (docs/metrics.md lists the series)."""
    body, content_type = get_state(request).metrics.render()
    return Response(body, media_type=content_type)


def build_request(state, body: GenerateRequest) -> tuple[dict[str, Any], dict[str, Any]]:
    """The processor request and the options of a /generate body (media decoded under the policy)."""
    request: dict[str, Any] = {}
    if body.text is not None:
        request["text"] = body.text
    media = []
    for part in body.media:
        if part.type == "image":
            item = {"type": "image", "data": decode_image(part.data, state.media_policy)}
        elif part.type == "audio":
            audio = decode_audio(part.data, state.media_policy)
            item = {"type": "audio", "data": audio.mono(), "sample_rate": audio.sample_rate}
        else:
            video = decode_video(part.data, state.media_policy)
            item = {"type": "video", "data": video.frames, "fps": video.fps}
        if part.name:
            item["name"] = part.name
        media.append(item)
    if media:
        request["media"] = media
    options = dict(body.options)
    if body.seed is not None:
        options["seed"] = body.seed
    if "modalities" in state.runtime.model.default_options and "modalities" not in options:
        options["modalities"] = list(body.outputs)
    return request, options


def to_chunk(item: Item, sample_rate: int):
    """The typed NDJSON chunk of one decoded output value."""
    value = item.value
    if isinstance(value, str):
        return TextChunk(output=item.name, seq=item.seq, delta=value)
    arr = np.asarray(value)
    if item.name == "audio" or item.name.endswith("audio"):
        return AudioChunk.from_array(item.name, item.seq, arr.astype(np.float32), sample_rate)
    if arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[-1] in (3, 4):
        data = base64.b64encode(encode_image(arr, "png")).decode()
        return ImageChunk(output=item.name, seq=item.seq, data=data, width=arr.shape[1], height=arr.shape[0])
    if arr.dtype == np.uint8 and arr.ndim == 4 and arr.shape[-1] == 3:
        data = base64.b64encode(encode_video(_even(arr), VIDEO_FPS)).decode()
        return VideoChunk(output=item.name, seq=item.seq, data=data, fps=VIDEO_FPS, frames=arr.shape[0])
    return TensorChunk.from_array(item.name, item.seq, arr)


def _even(frames: np.ndarray) -> np.ndarray:
    """H.264 wants even sides: pad by edge repetition."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge") if pad_h or pad_w else frames


@router.post("/generate", response_model=None, responses={
    200: {"model": GenerateResponse, "content": _NDJSON,
          "description": "one JSON answer; with `stream: true` an NDJSON stream of typed chunks"},
    409: {**_ERROR, "description": "`request_id` is already in flight"}})
async def generate(body: GenerateRequest, request: Request) -> Response:
    """Run the model on text and media; stream typed NDJSON chunks, or answer once with `stream: false`."""
    state = get_state(request)
    req, options = await run_in_threadpool(build_request, state, body)
    stream = await start_request(state, req, options, rid=body.request_id)
    wanted = set(body.outputs)
    rate = state.runtime.processor.sample_rate
    if not body.stream:
        outputs = await unless_disconnected(request, stream.collect(), [stream])
        chunks = {name: [await run_in_threadpool(to_chunk, i, rate) for i in items]
                  for name, items in outputs.items() if name in wanted}
        resp = GenerateResponse(request_id=stream.rid, outputs=chunks, finish_reason=stream.finish_reason or "stop",
                                usage=stream.usage)
        return Response(resp.model_dump_json(exclude_none=True), media_type="application/json")
    return ClosingStreamingResponse(guarded(lambda: _ndjson(stream, wanted, rate), _error_line), [stream],
                                    media_type="application/x-ndjson")


async def _ndjson(stream: RequestStream, wanted: set[str], rate: int):
    async for item in stream:
        if item.name in wanted:
            yield chunk_line(await run_in_threadpool(to_chunk, item, rate))
    yield chunk_line(FinalChunk(request_id=stream.rid, finish_reason=stream.finish_reason or "stop",
                                usage=stream.usage))


def _error_line(exc: RequestError) -> bytes:
    return chunk_line(ErrorChunk(status=exc.status if 400 <= exc.status <= 599 else 500, message=exc.message))
