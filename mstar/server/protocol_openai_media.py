"""OpenAI-compatible media endpoints: speech, images, videos and transcriptions.

Like chat, requests accept fields OpenAI does not define as per-request model options (`extra_options()`,
checked by `openai_fields`). Image
and video sizes are "WIDTHxHEIGHT" strings; `dimensions()` parses them.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mstar.server.protocol import MAX_SEED
from mstar.server.protocol_openai import new_id

MAX_SPEECH_CHARS = 16384
SAMPLE_RATE_HEADER = "x-sample-rate"  # response header of raw `pcm` speech: its sample rate in Hz
MAX_SIDE = 8192
_SIZE = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\d+)\s*$")


def parse_size(size: str) -> tuple[int, int]:
    """`"1024x768"` -> `(1024, 768)` (width, height); raises ValueError naming the bad value."""
    m = _SIZE.match(size)
    if m is None:
        raise ValueError(f"size must look like WIDTHxHEIGHT (e.g. 1024x768), got {size!r}")
    width, height = int(m.group(1)), int(m.group(2))
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
        raise ValueError(f"size sides must be between 1 and {MAX_SIDE}, got {size!r}")
    return width, height


class _Extras(BaseModel):
    model_config = ConfigDict(extra="allow")

    def extra_options(self) -> dict[str, Any]:
        """Fields OpenAI does not define: model options, or a 400 (`openai_fields.model_options`)."""
        return dict(self.model_extra or {})


class SpeechRequest(_Extras):
    """`POST /v1/audio/speech`."""

    model: str | None = None
    input: str = Field(min_length=1, max_length=MAX_SPEECH_CHARS)
    voice: str | None = None  # None: the model's default voice
    instructions: str | None = None
    response_format: Literal["wav", "pcm", "mp3", "opus", "flac", "aac"] = "mp3"
    stream_format: Literal["audio", "sse"] = "audio"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_id(cls, v: Any) -> Any:
        return v.get("id") if isinstance(v, dict) else v  # newer clients send {"id": "..."}


class SpeechUsage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0


class SpeechAudioDelta(BaseModel):
    """SSE event with base64 audio in the request's `response_format` (pcm: s16le)."""

    type: Literal["speech.audio.delta"] = "speech.audio.delta"
    audio: str
    sample_rate: int | None = None  # mstar extension: needed to play raw pcm


class SpeechAudioDone(BaseModel):
    """Last SSE event of a speech stream."""

    type: Literal["speech.audio.done"] = "speech.audio.done"
    usage: SpeechUsage = Field(default_factory=SpeechUsage)


class ImageGenerationRequest(_Extras):
    """`POST /v1/images/generations` (and the form fields of `/v1/images/edits`)."""

    prompt: str = Field(min_length=1, max_length=32000)
    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    size: str | None = None  # "WxH"; None or "auto": the model's default
    response_format: Literal["b64_json"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(None, ge=0, le=100)  # jpeg and webp quality
    # Images come out opaque at the model's own quality (steps set it): only values asking for that are served.
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    user: str | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0.0, le=100.0)

    @field_validator("response_format", mode="before")
    @classmethod
    def _only_b64(cls, v: Any) -> Any:
        if v == "url":
            raise ValueError("response_format 'url' is not supported (the server hosts no files); use b64_json")
        return v

    @field_validator("size")
    @classmethod
    def _check_size(cls, v: str | None) -> str | None:
        if v is not None and v != "auto":
            parse_size(v)
        return v

    @field_validator("quality", "style", "background", mode="before")
    @classmethod
    def _served_as_is(cls, v: Any, info) -> Any:
        allowed = {"quality": ("auto", "standard"), "style": (), "background": ("auto", "opaque")}[info.field_name]
        if v is not None and v not in allowed:
            fix = {"quality": "set num_inference_steps instead", "style": "leave it out",
                   "background": "every image is opaque"}[info.field_name]
            raise ValueError(f"{info.field_name} {v!r} is not served here; {fix}")
        return v

    @model_validator(mode="after")
    def _compression_format(self) -> ImageGenerationRequest:
        if self.output_compression is not None and self.output_format == "png":
            raise ValueError("output_compression applies to jpeg and webp; set output_format or leave it out")
        return self

    def dimensions(self) -> tuple[int, int] | None:
        """(width, height), or None for the model's default."""
        return None if self.size in (None, "auto") else parse_size(self.size)


class ImageEditRequest(ImageGenerationRequest):
    """Form fields of `POST /v1/images/edits`; the image (and mask) arrive as multipart files."""


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))
    data: list[ImageData]


class VideoCreateRequest(_Extras):
    """`POST /v1/videos` (JSON or multipart form; `input_reference` as a file or a data URL/base64)."""

    model: str | None = None
    prompt: str = Field(min_length=1, max_length=32000)
    seconds: float | None = Field(None, gt=0, le=600)  # OpenAI sends a string such as "4"
    size: str | None = None
    input_reference: str | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    fps: float | None = Field(None, gt=0, le=240)
    num_frames: int | None = Field(None, ge=1, le=10000)
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0.0, le=100.0)

    @field_validator("size")
    @classmethod
    def _check_size(cls, v: str | None) -> str | None:
        if v is not None:
            parse_size(v)
        return v

    @field_validator("input_reference", mode="before")
    @classmethod
    def _reference_url(cls, v: Any) -> Any:
        if isinstance(v, dict):  # OpenAI's reference object: {"image_url": ...} or {"file_id": ...}
            if "image_url" not in v:
                raise ValueError("input_reference must carry image_url (a data URL or base64); "
                                 "file ids are not supported here")
            return v["image_url"]
        return v

    def dimensions(self) -> tuple[int, int] | None:
        return None if self.size is None else parse_size(self.size)

    def seconds_text(self) -> str | None:
        """`seconds` the way OpenAI reports it: "4", or "2.5"."""
        return None if self.seconds is None else f"{self.seconds:g}"


class VideoJobError(BaseModel):
    code: str
    message: str


class VideoJob(BaseModel):
    """A video generation job, as `POST /v1/videos` and `GET /v1/videos/{id}` return it."""

    id: str = Field(default_factory=lambda: new_id("video"))
    object: Literal["video"] = "video"
    model: str | None = None
    status: Literal["queued", "in_progress", "completed", "failed"] = "queued"
    progress: int = Field(0, ge=0, le=100)
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    expires_at: int | None = None
    prompt: str | None = None
    seconds: str | None = None  # requested; the encoded clip's duration once completed
    size: str | None = None  # requested "WxH"; the encoded clip's size once completed
    error: VideoJobError | None = None


class VideoList(BaseModel):
    """`GET /v1/videos`: a page of jobs."""

    object: Literal["list"] = "list"
    data: list[VideoJob]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class VideoDeleted(BaseModel):
    """`DELETE /v1/videos/{id}`."""

    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


class TranscriptionRequest(_Extras):
    """Form fields of `POST /v1/audio/transcriptions`; the audio arrives as the multipart `file`."""

    model: str | None = None
    language: str | None = Field(None, pattern=r"^[A-Za-z]{2,3}([_-][A-Za-z]{2,4})?$")
    prompt: str | None = None
    response_format: Literal["json", "text", "verbose_json", "srt", "vtt"] = "json"
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    timestamp_granularities: list[Literal["word", "segment"]] | None = None
    stream: bool = False


class TranscriptionResponse(BaseModel):
    text: str
