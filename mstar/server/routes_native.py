"""Native routes: `POST /generate` (JSON or multipart in; NDJSON stream or one JSON answer out), /health,
/ready, /metrics.

Multipart /generate: text fields `text`, `outputs` (repeated, comma-separated or a JSON list),
`options` (a JSON object), `request_id`, `seed`, `stream`, `encoding`, `tensor_dtype`; media as file parts
named `files` (or `file`, `media`), typed by their Content-Type (image/*, audio/*, video/*; else 415); a file
part under another name is a 400 (JSON media carry the `name` of a model input).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from mstar.graph.spec import TO_CLIENT
from mstar.models.base import OptionError, OutputDecoder, TokenLogprobs, check_option_names
from mstar.server import logprobs
from mstar.server.adapters import Item, RequestError, RequestStream, start_request
from mstar.server.app import error_json, get_state
from mstar.server.forms import (
    files_of,
    inline_schema,
    is_form,
    json_or_form,
    read_form,
    refuse_stray_files,
    text_fields,
    upload_bytes,
    upload_modality,
    validate,
)
from mstar.server.media import (
    decode_audio,
    decode_image,
    decode_pcm16,
    decode_video,
    encode_image,
    encode_video,
)
from mstar.server.protocol import (
    ActionChunk,
    AudioChunk,
    ErrorChunk,
    ErrorResponse,
    FinalChunk,
    GenerateForm,
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


_ERROR = {"model": ErrorResponse}


@router.head("/health", include_in_schema=False)  # probes and `curl -I`: the GET status, no body
@router.get("/health", responses={503: {**_ERROR, "description": "unhealthy: restart the server"}})
async def health(request: Request) -> Response:
    """200 while the process can serve (no key needed); 503 once the runtime gave up (a worker died too
    often) or makes no progress with requests in flight, so an orchestrator restarts it."""
    problem = await run_in_threadpool(get_state(request).runtime.health_problem)
    if problem:
        return error_json(503, f"unhealthy: {problem}")
    return JSONResponse({"status": "ok"})
_NDJSON = {"application/x-ndjson": {"schema": {"type": "string", "description": "one JSON chunk per line"}}}


@router.head("/ready", include_in_schema=False)
@router.get("/ready", responses={503: {**_ERROR, "description": "still loading, or stopping"}})
async def ready(request: Request) -> Response:
    """200 once every worker is loaded; 503 before, while a worker restarts, while shutting down and
    while /health is unhealthy."""
    runtime = get_state(request).runtime
    if not runtime.ready:
        return error_json(503, "the model is still loading, a worker is restarting, or the server is stopping")
    problem = await run_in_threadpool(runtime.health_problem)
    if problem:
        return error_json(503, f"unhealthy: {problem}")
    return JSONResponse({"status": "ready"})


@router.head("/metrics", include_in_schema=False)  # `curl -I` and scrapers' checks: the GET's headers, no body
@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    """Prometheus exposition text (docs/metrics.md lists the series)."""
    body, content_type = get_state(request).metrics.render()
    return Response(body, media_type=content_type)


def client_outputs(runtime) -> list[str]:
    """The outputs /generate may ask for: the model's modalities, whatever its walks send the client
    (`progress`, `frames`, ...) and `logprobs` where its decoder gives them."""
    emitted = {e.name for walk in runtime.graph.walks for e in walk.emits if e.to == TO_CLIENT}
    extra = {"logprobs"} if runtime.processor.returns_logprobs else set()
    return sorted(set(runtime.model.output_modalities) | emitted | extra)


def check_outputs(state, outputs: list[str], param: str = "outputs") -> None:
    """A 400 naming an output the model never sends, which would otherwise run the request to its end
    and answer nothing (`param`: the field that named it, `outputs` or option `modalities`)."""
    known = client_outputs(state.runtime)
    unknown = [name for name in outputs if name not in known]
    if unknown:
        raise RequestError(400, f"model {state.model_name!r} has no output {unknown[0]!r}; its outputs are "
                                f"{', '.join(known)}", param)


def build_request(state, body: GenerateRequest, uploads: list[tuple[str, bytes]] = ()
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The processor request and the options of a /generate body (media decoded under the policy);
    `uploads` are (modality, bytes) of multipart file parts, appended after the JSON media."""
    check_outputs(state, body.outputs)
    try:  # the client's own names only: `seed` and what this route adds below are the route's
        check_option_names(state.model_name, state.runtime.model.accepted_options(), body.options)
    except OptionError as exc:
        raise RequestError(400, str(exc), exc.option) from None
    if isinstance(body.options.get("modalities"), list):  # another kind is refused by the option type check
        check_outputs(state, body.options["modalities"], "modalities")
    request: dict[str, Any] = {}
    if body.text is not None:
        request["text"] = body.text
    media = [_decode(state, part.type, part.data, part.name, part.format) for part in body.media]
    media += [_decode(state, kind, data, None) for kind, data in uploads]
    if media:
        request["media"] = media
    options = dict(body.options)
    if body.seed is not None:
        options["seed"] = body.seed
    if "modalities" in state.runtime.model.default_options and "modalities" not in options:
        options["modalities"] = [name for name in body.outputs if name != "logprobs"]  # logprobs are no modality
    if "logprobs" in body.outputs:  # output logprobs alone asks for each token's own, as option logprobs: 0
        options.setdefault("logprobs", 0)
    if "report_progress" in state.runtime.model.default_options and "progress" in body.outputs:
        options.setdefault("report_progress", True)
    return request, options


def _decode(state, kind: str, data, name: str | None, fmt: str | None = None) -> dict[str, Any]:
    if kind == "image":
        item = {"type": "image", "data": decode_image(data, state.policy("/generate"))}
    elif kind == "audio":  # raw pcm16 has no header to tell it by; any other format the bytes tell
        audio = (decode_pcm16 if fmt == "pcm16" else decode_audio)(data, state.policy("/generate"))
        item = {"type": "audio", "data": audio.mono(), "sample_rate": audio.sample_rate}
    else:
        video = decode_video(data, state.policy("/generate"))
        item = video.media_item()
    if name:
        item["name"] = name
    return item


_FORM_FILES = ("files", "file", "media")
_GENERATE_SCHEMA = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": inline_schema(GenerateRequest)},
    "multipart/form-data": {"schema": {"type": "object", "properties": {
        "text": {"type": "string"}, "files": {"type": "array", "items": {"type": "string", "format": "binary"}},
        "outputs": {"type": "string"}, "options": {"type": "string"}, "request_id": {"type": "string"},
        "seed": {"type": "integer"}, "stream": {"type": "boolean"},
        "encoding": {"type": "string", "enum": ["auto", "json", "binary"]},
        "tensor_dtype": {"type": "string", "enum": ["float32", "bfloat16"]}}}}}}}


async def read_generate(request: Request, state) -> tuple[GenerateRequest, list[tuple[str, bytes]]]:
    """The /generate body from JSON or multipart, and the uploaded files as (modality, bytes)."""
    if not is_form(request):
        body, _ = await json_or_form(request, GenerateRequest)
        return body, []
    form = await read_form(request)
    fields = {k: v for k, v in form_fields_of(form).items() if k not in _FORM_FILES}
    body = validate(GenerateForm, fields)
    refuse_stray_files(form, "/generate", _FORM_FILES, "to feed a named input (a camera, goal) send JSON media "
                                                        "with `name`")
    uploads = []
    for upload in files_of(form, *_FORM_FILES):
        kind = upload_modality(upload, "files")
        uploads.append((kind, await upload_bytes(upload, "files", state.policy("/generate"))))
    if body.text is None and not uploads:
        raise RequestError(400, "a request needs `text` or at least one file part (`files`)")
    return body, uploads


def form_fields_of(form) -> dict[str, Any]:
    """Multipart text fields with `outputs` as a list and `options` as a dict (see the module doc)."""
    fields = text_fields(form)
    outputs = fields.get("outputs")
    if isinstance(outputs, str):
        outputs = outputs.strip()
        fields["outputs"] = _json(outputs, "outputs") if outputs.startswith("[") else \
            [o.strip() for o in outputs.split(",") if o.strip()]
    if isinstance(fields.get("options"), str):
        fields["options"] = _json(fields["options"], "options")
    return fields


def _json(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise RequestError(400, f"form field {field!r} is not valid JSON: {exc}", field) from None


@dataclass(frozen=True)
class ArrayForm:
    """How a request wants its array outputs written (GenerateRequest's `encoding` and `tensor_dtype`)."""

    binary: bool | None = None  # raw bytes in `data`, JSON numbers in `values`, None: numbers for actions only
    tensor_dtype: str | None = None  # float tensor chunks in this dtype; None keeps the output's own

    @classmethod
    def of(cls, body: GenerateRequest) -> ArrayForm:
        return cls(binary={"auto": None, "json": False, "binary": True}[body.encoding], tensor_dtype=body.tensor_dtype)


def to_chunk(item: Item, sample_rate: int, fps: float = VIDEO_FPS, decoder: OutputDecoder | None = None,
             arrays: ArrayForm = ArrayForm()):
    """The typed NDJSON chunk of one decoded output value; videos are encoded at `fps`, a token's logprobs
    named by `decoder`'s tokenizer, arrays written as `arrays` says."""
    value = item.value
    if isinstance(value, str):
        return TextChunk(output=item.name, seq=item.seq, delta=value)
    if isinstance(value, TokenLogprobs):
        assert decoder is not None, "logprobs are named by the request's decoder"
        return logprobs.chunk(decoder, value, item.name, item.seq)
    arr = np.asarray(value)
    if item.name == "audio" or item.name.endswith("audio"):
        return AudioChunk.from_array(item.name, item.seq, arr.astype(np.float32), sample_rate)
    if item.name == "actions" and arr.dtype.kind == "f":  # robot actions (a policy's chunk, a V-JEPA 2-AC plan)
        return ActionChunk.from_array(item.name, item.seq, arr, arrays.binary is True, "float32")
    if arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[-1] in (3, 4):
        data = base64.b64encode(encode_image(arr, "png")).decode()
        return ImageChunk(output=item.name, seq=item.seq, data=data, width=arr.shape[1], height=arr.shape[0])
    if arr.dtype == np.uint8 and arr.ndim == 4 and arr.shape[-1] == 3:
        data = base64.b64encode(encode_video(_even(arr), fps)).decode()
        return VideoChunk(output=item.name, seq=item.seq, data=data, fps=fps, frames=arr.shape[0])
    dtype = arrays.tensor_dtype if arr.dtype.kind == "f" else None
    return TensorChunk.from_array(item.name, item.seq, arr, arrays.binary is not False, dtype)


def _even(frames: np.ndarray) -> np.ndarray:
    """H.264 wants even sides: pad by edge repetition."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge") if pad_h or pad_w else frames


@router.post("/generate", response_model=None, openapi_extra=_GENERATE_SCHEMA, responses={
    200: {"model": GenerateResponse, "content": _NDJSON,
          "description": "one JSON answer; with `stream: true` an NDJSON stream of typed chunks"},
    409: {**_ERROR, "description": "`request_id` is already in flight"}})
async def generate(request: Request) -> Response:
    """Run the model on text and media; stream typed NDJSON chunks, or answer once with `stream: false`.
    Array outputs come as JSON numbers (actions, by default) or raw little-endian bytes (tensors, by default;
    `encoding` sets both); `tensor_dtype: "bfloat16"` halves the bytes of float tensors (docs/generate.md)."""
    state = get_state(request)
    body, uploads = await read_generate(request, state)
    req, options = await run_in_threadpool(build_request, state, body, uploads)
    stream = await start_request(state, req, options, rid=body.request_id)
    wanted = set(body.outputs)
    if options.get("logprobs") is not None:  # asked for by option: sent whether or not `outputs` names them
        wanted.add("logprobs")
    rate = state.runtime.processor.sample_rate
    fps, arrays = _fps(stream.decoder.options), ArrayForm.of(body)
    if not body.stream:
        outputs = await unless_disconnected(request, stream.collect(), [stream])
        chunks = {name: [await run_in_threadpool(to_chunk, i, rate, fps, stream.decoder, arrays) for i in items]
                  for name, items in outputs.items() if name in wanted}
        resp = GenerateResponse(request_id=stream.rid, outputs=chunks, finish_reason=stream.finish_reason or "stop",
                                usage=stream.usage)
        return Response(resp.model_dump_json(exclude_none=True), media_type="application/json")
    return ClosingStreamingResponse(guarded(lambda: _ndjson(stream, wanted, rate, fps, arrays), _error_line), [stream],
                                    media_type="application/x-ndjson")


def _fps(options) -> float:
    """The request's `fps` option (models with a frame rate resolve it), else VIDEO_FPS."""
    fps = options.get("fps")
    return float(fps) if isinstance(fps, (int, float)) and not isinstance(fps, bool) and fps > 0 else VIDEO_FPS


async def _ndjson(stream: RequestStream, wanted: set[str], rate: int, fps: float, arrays: ArrayForm):
    async for item in stream:
        if item.name in wanted:
            yield chunk_line(await run_in_threadpool(to_chunk, item, rate, fps, stream.decoder, arrays))
    yield chunk_line(FinalChunk(request_id=stream.rid, finish_reason=stream.finish_reason or "stop",
                                usage=stream.usage))


def _error_line(exc: RequestError) -> bytes:
    return chunk_line(ErrorChunk(status=exc.status if 400 <= exc.status <= 599 else 500, message=exc.message))
