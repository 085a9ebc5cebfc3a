"""A small fake mstar server for SDK tests: real HTTP on 127.0.0.1, canned model behaviour.

Prompts steer it: "fail-early" answers an HTTP error, "fail-late" streams some output and then an
in-band error. Every route but /health needs the bearer token API_KEY.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from mstar.server.media import encode_audio, encode_image, encode_video
from mstar.server.protocol import (
    AudioChunk,
    ErrorChunk,
    FinalChunk,
    GenerateRequest,
    GenerateResponse,
    ImageChunk,
    TextChunk,
    Usage,
    chunk_line,
    error_response,
    validation_message,
)
from mstar.server.protocol_openai import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from mstar.server.protocol_openai_media import (
    ImageGenerationRequest,
    SpeechAudioDelta,
    SpeechAudioDone,
    SpeechRequest,
    VideoCreateRequest,
    VideoJob,
)

API_KEY = "test-key"
RATE = 16000


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_response(status, message, param).model_dump(), status_code=status)


async def _parse(request: Request, model):
    try:
        return model.model_validate(await request.json()), None
    except ValidationError as exc:
        return None, _error(400, *validation_message(exc))


def _generate_chunks(req: GenerateRequest):
    words = (req.text or "").split()
    kinds = ",".join(m.type for m in req.media)
    yield TextChunk(output="text", seq=0, delta=f"[{kinds}] ")
    for i, word in enumerate(words, start=1):
        yield TextChunk(output="text", seq=i, delta=word + " ")
    if "fail-late" in words:
        yield ErrorChunk(status=500, message="worker 1 died mid-request")
        return
    if "audio" in req.outputs:
        tone = np.sin(np.arange(RATE // 10) * 0.1).astype(np.float32) * 0.5
        yield AudioChunk.from_array("audio", 0, tone, RATE)
        yield AudioChunk.from_array("audio", 1, tone, RATE)
    if "image" in req.outputs:
        png = encode_image(np.full((8, 12, 3), 99, np.uint8))
        yield ImageChunk(output="image", seq=0, data=base64.b64encode(png).decode(), width=12, height=8)
    usage = Usage(prompt_tokens=len(words), completion_tokens=len(words) + 1)
    yield FinalChunk(request_id=req.request_id, finish_reason="stop", usage=usage)


def _sse(events):
    for event in events:
        payload = event if isinstance(event, str) else event.model_dump_json(exclude_none=True)
        yield f"data: {payload}\n\n"


async def auth(request: Request, call_next):
    if request.url.path != "/health" and request.headers.get("authorization") != f"Bearer {API_KEY}":
        return _error(401, "missing or wrong API key")
    return await call_next(request)


async def health():
    return {"status": "healthy"}


async def generate(request: Request):
    req, err = await _parse(request, GenerateRequest)
    if err:
        return err
    if req.text and "fail-early" in req.text:
        return _error(503, "no worker is ready")
    if req.stream:
        return StreamingResponse(
            (chunk_line(c) for c in _generate_chunks(req)), media_type="application/x-ndjson"
        )
    chunks = list(_generate_chunks(req))
    if isinstance(chunks[-1], ErrorChunk):
        return _error(chunks[-1].status, chunks[-1].message)
    outputs: dict = {}
    for c in chunks[:-1]:
        outputs.setdefault(c.output, []).append(c)
    resp = GenerateResponse(
        request_id=req.request_id, outputs=outputs, finish_reason="stop", usage=chunks[-1].usage
    )
    return Response(resp.model_dump_json(), media_type="application/json")


async def chat(request: Request):
    req, err = await _parse(request, ChatCompletionRequest)
    if err:
        return err
    text = f"echo: {req.messages[-1].text()}"
    if not req.stream:
        return ChatCompletion(
            model="fake",
            choices=[{"message": {"content": text}}],
            usage={"prompt_tokens": 2, "completion_tokens": 3},
        ).model_dump()
    return StreamingResponse(_sse(_chat_events(req, text)), media_type="text/event-stream")


def _chat_events(req: ChatCompletionRequest, text: str):
    for piece in text.split(" "):
        yield ChatCompletionChunk(id="c1", model="fake", choices=[{"delta": {"content": piece + " "}}])
    if "fail-late" in text:
        yield json.dumps(error_response(500, "decode step failed").model_dump())
        return
    yield ChatCompletionChunk(id="c1", model="fake", choices=[{"delta": {}, "finish_reason": "stop"}])
    if req.stream_options and req.stream_options.include_usage:
        yield ChatCompletionChunk(id="c1", model="fake", usage={"prompt_tokens": 2, "completion_tokens": 3})
    yield "[DONE]"


async def speech(request: Request):
    req, err = await _parse(request, SpeechRequest)
    if err:
        return err
    tone = (np.sin(np.arange(RATE // 4) * 0.05) * 0.3).astype(np.float32)
    if req.stream_format == "audio":
        return Response(encode_audio(tone, RATE, req.response_format), media_type="audio/wav")
    return StreamingResponse(_sse(_speech_events(req, tone)), media_type="text/event-stream")


def _speech_events(req: SpeechRequest, tone: np.ndarray):
    for piece in np.array_split(tone, 4):
        yield SpeechAudioDelta(
            audio=base64.b64encode(encode_audio(piece, RATE, "pcm")).decode(), sample_rate=RATE
        )
        if "fail-late" in req.input:
            yield json.dumps({"type": "error", "error": {"message": "vocoder crashed", "code": 500}})
            return
    yield SpeechAudioDone()


async def images(request: Request):
    req, err = await _parse(request, ImageGenerationRequest)
    if err:
        return err
    width, height = req.dimensions() or (16, 16)
    png = encode_image(np.full((height, width, 3), 7, np.uint8))
    return {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(png).decode()}] * req.n}


async def create_video(request: Request):
    req, err = await _parse(request, VideoCreateRequest)
    if err:
        return err
    job = VideoJob(model="fake", size=req.size)
    request.app.state.jobs[job.id] = {
        "job": job,
        "polls": 0,
        "fail": "fail-late" in req.prompt,
        "ref": req.input_reference,
    }
    return job.model_dump()


async def get_video(request: Request, video_id: str):
    entry = request.app.state.jobs[video_id]
    entry["polls"] += 1
    if entry["polls"] >= 2:
        failed = entry["fail"]
        entry["job"] = VideoJob.model_validate(
            {
                **entry["job"].model_dump(),
                "status": "failed" if failed else "completed",
                "progress": 100,
                "error": {"code": "internal", "message": "denoiser diverged"} if failed else None,
            }
        )
    return entry["job"].model_dump()


async def video_content(video_id: str):
    frames = np.zeros((5, 16, 16, 3), np.uint8)
    return Response(encode_video(frames, fps=5), media_type="video/mp4")


def build_app() -> FastAPI:
    """The fake server's app: the routes above on a fresh job table."""
    app = FastAPI()
    app.state.jobs = {}
    app.middleware("http")(auth)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/generate", generate, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/audio/speech", speech, methods=["POST"])
    app.add_api_route("/v1/images/generations", images, methods=["POST"])
    app.add_api_route("/v1/videos", create_video, methods=["POST"])
    app.add_api_route("/v1/videos/{video_id}", get_video, methods=["GET"])
    app.add_api_route("/v1/videos/{video_id}/content", video_content, methods=["GET"])
    return app


class FakeServer:
    """uvicorn in a daemon thread on a free 127.0.0.1 port."""

    def __init__(self) -> None:
        self.app = build_app()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self) -> FakeServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start within 10 s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
