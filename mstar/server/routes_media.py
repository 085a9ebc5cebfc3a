"""OpenAI-compatible media routes: /v1/audio/speech, /v1/images/generations and /v1/images/edits."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel
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
from mstar.server.media import AUDIO_MIME, decode_image, encode_audio, encode_image, pcm_s16le
from mstar.server.openai_fields import model_options, voice_option
from mstar.server.openapi import BINARY, SSE
from mstar.server.protocol_openai_media import (
    SAMPLE_RATE_HEADER,
    ImageData,
    ImageEditRequest,
    ImageGenerationRequest,
    ImagesResponse,
    SpeechAudioDelta,
    SpeechAudioDone,
    SpeechRequest,
    SpeechUsage,
)
from mstar.server.streaming import ClosingStreamingResponse, guarded, sse, sse_error, unless_disconnected

router = APIRouter()


def _set_fields(body: BaseModel, names: tuple[str, ...]) -> dict[str, Any]:
    """The fields among `names` the request set, by name: the model options they become."""
    return {name: getattr(body, name) for name in names if getattr(body, name) is not None}


def _media_options(state: ServerState, options: dict[str, Any], modality: str, seed: int | None) -> dict[str, Any]:
    opts = dict(options)
    if seed is not None:
        opts["seed"] = seed
    if "modalities" in state.runtime.model.default_options:
        opts["modalities"] = [modality]
    return opts


async def _samples(stream: RequestStream) -> np.ndarray:
    pieces = [np.asarray(item.value, dtype=np.float32).reshape(-1) async for item in stream if item.name == "audio"]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)


_SPEECH_OK = {200: {"content": {**{mime: BINARY for mime in AUDIO_MIME.values()}, "text/event-stream": SSE},
                    "description": "the audio file in `response_format`; with `stream_format: sse` SSE events "
                                   "(speech.audio.delta, then speech.audio.done)"}}


# response_class=Response: the success body is never JSON, so no application/json entry is documented.
@router.post("/v1/audio/speech", response_model=None, response_class=Response, responses=_SPEECH_OK)
async def speech(body: SpeechRequest, request: Request) -> Response:
    """Text to speech in any of wav, pcm, flac, mp3, opus, aac; streamed as raw audio or SSE."""
    state = get_state(request)
    state.check_model(body.model, "audio", "/v1/audio/speech")
    fields = _set_fields(body, ("instructions", "temperature", "top_p", "seed"))
    if body.speed != 1.0:
        fields["speed"] = body.speed
    opts = model_options(state, "/v1/audio/speech", body, body.extra_options(), fields, owned=("modalities",))
    if body.voice is not None:
        opts.update(voice_option(state, body.voice))
    opts = _media_options(state, opts, "audio", body.seed)
    stream = await start_request(state, {"text": body.input}, opts)
    rate = state.runtime.processor.sample_rate
    fmt = body.response_format
    headers = {SAMPLE_RATE_HEADER: str(rate)}
    if body.stream_format == "sse":
        return ClosingStreamingResponse(guarded(lambda: _speech_sse(stream, fmt, rate), sse_error), [stream],
                                        media_type="text/event-stream", headers=headers)
    if fmt == "pcm":  # raw s16le streams as it is made; containers are encoded whole (valid headers)
        return ClosingStreamingResponse(_raw_pcm(stream), [stream], media_type=AUDIO_MIME[fmt], headers=headers)
    samples = await unless_disconnected(request, _samples(stream), [stream])
    if samples.size == 0:
        raise RequestError(500, "the model produced no audio for this input")
    data = await run_in_threadpool(encode_audio, samples, rate, fmt)
    return Response(data, media_type=AUDIO_MIME[fmt], headers=headers)


async def _raw_pcm(stream: RequestStream):
    """s16le chunks as they come. A late failure ends the body early (raw audio has no place for an
    error; use stream_format=sse to see it)."""
    try:
        async for item in stream:
            if item.name == "audio":
                yield pcm_s16le(np.asarray(item.value, dtype=np.float32).reshape(-1))
    except RequestError:
        return


async def _speech_sse(stream: RequestStream, fmt: str, rate: int):
    if fmt == "pcm":
        async for item in stream:
            if item.name == "audio":
                pcm = pcm_s16le(np.asarray(item.value, dtype=np.float32).reshape(-1))
                yield sse(SpeechAudioDelta(audio=base64.b64encode(pcm).decode(), sample_rate=rate))
    else:  # container formats are encoded whole, then sent as one delta
        samples = await _samples(stream)
        data = await run_in_threadpool(encode_audio, samples, rate, fmt)
        yield sse(SpeechAudioDelta(audio=base64.b64encode(data).decode(), sample_rate=rate))
    usage = stream.usage
    yield sse(SpeechAudioDone(usage=SpeechUsage(input_tokens=usage.prompt_tokens,
                                                output_tokens=usage.completion_tokens,
                                                total_tokens=usage.total_tokens)))


async def _first_image(stream: RequestStream) -> np.ndarray:
    image = None
    async for item in stream:
        if item.name == "image" and image is None:
            image = np.asarray(item.value)
    if image is None:
        raise RequestError(500, "the model produced no image for this prompt")
    return image


@router.post("/v1/images/generations")
async def image_generations(body: ImageGenerationRequest, request: Request) -> ImagesResponse:
    """Text to image; b64_json PNG/JPEG/WEBP, n images from n requests (seed + i)."""
    state = get_state(request)
    state.check_model(body.model, "image", "/v1/images/generations")
    opts = _image_options(state, "/v1/images/generations", body, body.extra_options())
    return await _images(state, request, body, {"text": body.prompt}, opts)


_EDIT_FORM_SCHEMA = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["image", "prompt"],
    "properties": {"image": {"type": "array", "items": {"type": "string", "format": "binary"}},
                   "mask": {"type": "string", "format": "binary"}, "prompt": {"type": "string"},
                   "model": {"type": "string"}, "n": {"type": "integer"}, "size": {"type": "string"},
                   "response_format": {"type": "string"}, "output_format": {"type": "string"},
                   "output_compression": {"type": "integer"},
                   "seed": {"type": "integer"}}}}}}}


@router.post("/v1/images/edits", openapi_extra=_EDIT_FORM_SCHEMA)
async def image_edits(request: Request) -> ImagesResponse:
    """Image(s) + prompt (+ optional mask) -> edited images (multipart, like OpenAI's images.edit)."""
    state = get_state(request)
    form = await read_form(request)
    refuse_stray_files(form, "/v1/images/edits", ("image", "mask"))
    body = validate(ImageEditRequest, {k: v for k, v in text_fields(form).items() if k not in ("image", "mask")})
    state.check_model(body.model, "image", "/v1/images/edits")
    if "image" not in state.runtime.model.input_modalities:
        raise RequestError(404, f"/v1/images/edits is not available for model {state.model_name!r}: "
                                "it takes no image input")
    opts = _image_options(state, "/v1/images/edits", body, form_options(body.extra_options()))
    images = files_of(form, "image") or [v for v in form.getlist("image") + form.getlist("image[]") if v]
    if not images:
        raise RequestError(400, "/v1/images/edits needs at least one `image` (a file part, or a data URL)", "image")
    if len(images) > 16:
        raise RequestError(400, f"at most 16 images per edit, got {len(images)}", "image")
    media = [{"type": "image", "data": await _image(state, img, "image")} for img in images]
    masks = files_of(form, "mask") or [v for v in form.getlist("mask") if isinstance(v, str) and v]
    if masks:
        media.append({"type": "image", "name": "mask", "data": await _image(state, masks[0], "mask")})
    return await _images(state, request, body, {"text": body.prompt, "media": media}, opts)


async def _image(state: ServerState, value, field: str) -> np.ndarray:
    policy = state.policy("/v1/images/edits")
    data = await media_bytes(value, field, policy)
    return await run_in_threadpool(decode_image, data, policy)


def _image_options(state: ServerState, route: str, body: ImageGenerationRequest, extras: dict[str, Any],
                   ) -> dict[str, Any]:
    """The model options of an image request (`extras`: its fields beyond OpenAI's), checked."""
    fields = _set_fields(body, ("negative_prompt", "num_inference_steps", "guidance_scale", "seed"))
    dims = body.dimensions()
    if dims is not None:  # as `size`, which a model may snap to its multiple
        fields["size"] = f"{dims[0]}x{dims[1]}"
    return model_options(state, route, body, extras, fields, owned=("modalities",))


async def _images(state: ServerState, request: Request, body: ImageGenerationRequest,
                  model_request: dict[str, Any], options: dict[str, Any]) -> ImagesResponse:
    """Run `body.n` requests (seed + i) for `model_request` with `options` and encode the first image of each."""
    streams: list[RequestStream] = []
    try:
        for i in range(body.n):
            seed = None if body.seed is None else body.seed + i
            streams.append(await start_request(state, model_request, _media_options(state, options, "image", seed)))
        data = []
        for stream in streams:
            image = await unless_disconnected(request, _first_image(stream), streams)
            quality = 90 if body.output_compression is None else body.output_compression
            encoded = await run_in_threadpool(encode_image, image.astype(np.uint8), body.output_format, quality)
            data.append(ImageData(b64_json=base64.b64encode(encoded).decode()))
    finally:
        for stream in streams:
            stream.close()
    return ImagesResponse(data=data)
