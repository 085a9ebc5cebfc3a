"""The OpenAI videos resource: `POST /v1/videos` creates a job, `GET /v1/videos/{id}` reports its
status and progress, `GET /v1/videos/{id}/content` returns the MP4, `GET /v1/videos` lists jobs and
`DELETE /v1/videos/{id}` removes one (cancelling it when it still runs). Jobs live in a bounded
in-memory store (`video_jobs.py`), one per app. `POST /v1/videos/generations` (the original M*'s route)
takes the same body and answers the MP4 itself, synchronously, keeping no job."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from mstar.server.adapters import RequestError, RequestStream, start_request
from mstar.server.app import ServerState, get_state
from mstar.server.forms import files_of, form_options, json_or_form, media_bytes
from mstar.server.media import decode_image
from mstar.server.openai_fields import model_options
from mstar.server.openapi import errors
from mstar.server.protocol_openai_media import VideoCreateRequest, VideoDeleted, VideoJob, VideoList
from mstar.server.streaming import unless_disconnected
from mstar.server.video_jobs import VideoJobStore, VideoRecord, run_job

router = APIRouter()
DEFAULT_FPS = 8.0  # for models that do not say (the option `fps` overrides it)
POLL_AFTER_MS = "250"  # the openai client's poll helper waits this long between retrieves

_CREATE_SCHEMA = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": VideoCreateRequest.model_json_schema()},
    "multipart/form-data": {"schema": {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"type": "string"}, "model": {"type": "string"}, "seconds": {"type": "string"},
        "size": {"type": "string"}, "input_reference": {"type": "string", "format": "binary"}}}}}}}


VIDEO_SHARE = 4  # video jobs may hold at most a quarter of the request slots, leaving the rest to chat


def job_store(request: Request) -> VideoJobStore:
    """The app's job store, made on first use."""
    store = getattr(request.app.state, "mstar_video_jobs", None)
    if store is None:
        slots = get_state(request).runtime.config.max_concurrent_requests
        store = request.app.state.mstar_video_jobs = VideoJobStore(max_running=max(1, slots // VIDEO_SHARE))
    return store


def _job_response(job: VideoJob) -> JSONResponse:
    return JSONResponse(job.model_dump(), headers={"openai-poll-after-ms": POLL_AFTER_MS})


_CONTENT = {200: {"description": "the MP4 (`variant=video`) or a PNG of the first frame (`variant=thumbnail`)",
                  "content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}},
                              "image/png": {"schema": {"type": "string", "format": "binary"}}}}}


@router.post("/v1/videos", openapi_extra=_CREATE_SCHEMA, response_model=VideoJob, responses=errors(429))
async def create_video(request: Request) -> JSONResponse:
    """Start a video job (JSON or multipart; `input_reference` as a file part, data URL or base64)."""
    store = job_store(request)
    record, stream = await _start(request, "/v1/videos", store.make_room)  # refused before work that cannot be kept
    store.add(record)
    record.task = asyncio.create_task(run_job(record, stream), name=f"video-job-{record.job.id}")
    return _job_response(record.job)


@router.post("/v1/videos/generations", openapi_extra=_CREATE_SCHEMA, response_model=None,
             responses={200: {"description": "the MP4", "content": {"video/mp4": {"schema": {
                 "type": "string", "format": "binary"}}}}, **errors(429, 500)})
async def generate_video(request: Request) -> Response:
    """The body of POST /v1/videos; the MP4 itself once it is made (H.264, AAC when the model made sound)."""
    record, stream = await _start(request, "/v1/videos/generations")
    await unless_disconnected(request, run_job(record, stream), [stream])
    if record.mp4 is None:
        raise RequestError(500, record.job.error.message if record.job.error else "the video was not made")
    return Response(record.mp4, media_type="video/mp4")


async def _start(request: Request, route: str, before: Callable[[], None] = lambda: None,
                 ) -> tuple[VideoRecord, RequestStream]:
    """The job record of a video request and its model request's stream (started after `before()`)."""
    state = get_state(request)
    body, form = await json_or_form(request, VideoCreateRequest, file_fields=("input_reference",))
    state.check_model(body.model, "video", route)
    opts = _options(state, route, body)
    reference = (files_of(form, "input_reference") if form is not None else []) or [body.input_reference]
    model_request: dict[str, Any] = {"text": body.prompt}
    if reference[0] is not None:
        model_request["media"] = [{"type": "image", "name": "input_reference",
                                   "data": await _reference_image(state, reference[0], route)}]
    before()
    stream = await start_request(state, model_request, opts)
    job = VideoJob(model=state.model_name, prompt=body.prompt, seconds=body.seconds_text(), size=body.size)
    # the model's resolved options hold its frame rate when the request gave none (wan22: 24)
    fps = stream.decoder.options.get("fps") or opts.get("fps") or DEFAULT_FPS
    return VideoRecord(job, fps=float(fps), sample_rate=state.runtime.processor.sample_rate), stream


async def _reference_image(state: ServerState, value, route: str) -> Any:
    if "image" not in state.runtime.model.input_modalities:
        raise RequestError(400, f"model {state.model_name!r} takes no image input; leave input_reference out",
                           "input_reference")
    data = await media_bytes(value, "input_reference", state.policy(route))
    return await run_in_threadpool(decode_image, data, state.policy(route))


def _options(state: ServerState, route: str, body: VideoCreateRequest) -> dict[str, Any]:
    names = ("seconds", "seed", "fps", "num_frames", "negative_prompt", "num_inference_steps", "guidance_scale")
    fields = {name: getattr(body, name) for name in names if getattr(body, name) is not None}
    dims = body.dimensions()
    if dims is not None:  # as `size`, which a model may snap to its multiple (the job then names the size made)
        fields["size"] = f"{dims[0]}x{dims[1]}"
    opts = model_options(state, route, body, form_options(body.extra_options()), fields,
                         owned=("modalities", "report_progress"))
    defaults = state.runtime.model.default_options
    if "modalities" in defaults:  # sound is muxed into the MP4 when the model can make it
        opts["modalities"] = ["video"] + (["audio"] if "audio" in state.runtime.model.output_modalities else [])
    if "report_progress" in defaults:
        opts["report_progress"] = True
    return opts


@router.get("/v1/videos/{video_id}", response_model=VideoJob, responses=errors(404))
async def retrieve_video(video_id: str, request: Request) -> JSONResponse:
    """The job's status, progress (0-100) and, when it failed, its error."""
    return _job_response(job_store(request).get(video_id).job)


@router.get("/v1/videos/{video_id}/content", response_model=None, responses={**_CONTENT, **errors(404, 409)})
async def video_content(video_id: str, request: Request,
                        variant: Literal["video", "thumbnail"] = Query("video")) -> Response:
    """The MP4 (H.264, AAC when the model made sound), or a PNG of the first frame (`thumbnail`)."""
    record = job_store(request).get(video_id)
    if record.job.status == "failed":
        raise RequestError(409, f"video job {video_id!r} failed: {record.job.error.message if record.job.error else ''}")
    if record.mp4 is None:
        raise RequestError(409, f"video job {video_id!r} is {record.job.status} ({record.job.progress}%); "
                                f"poll GET /v1/videos/{video_id} until its status is completed")
    if variant == "thumbnail":
        return Response(record.thumbnail_png, media_type="image/png")
    return Response(record.mp4, media_type="video/mp4")


@router.get("/v1/videos", response_model=VideoList, responses=errors(404))
async def list_videos(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100),
                      order: Literal["asc", "desc"] = "desc") -> VideoList:
    """Jobs this server still keeps, newest first by default."""
    records, has_more = job_store(request).page(after, limit, order)
    jobs = [r.job for r in records]
    return VideoList(data=jobs, has_more=has_more, first_id=jobs[0].id if jobs else None,
                     last_id=jobs[-1].id if jobs else None)


@router.delete("/v1/videos/{video_id}", response_model=VideoDeleted, responses=errors(404))
async def delete_video(video_id: str, request: Request) -> VideoDeleted:
    """Forget a job and its files; a running job is cancelled, its model request too."""
    job_store(request).delete(video_id)
    return VideoDeleted(id=video_id)
