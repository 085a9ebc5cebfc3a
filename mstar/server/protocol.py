"""The native HTTP protocol: `POST /generate` requests, NDJSON stream chunks, errors and usage.

A stream is one JSON object per line. Chunks of an output carry the output's name (`output`) and a
per-output sequence number (`seq`, from 0, no gaps); a stream ends with exactly one `final` chunk, or
with an `error` chunk when the request fails after streaming began. Clients must raise on `error`.

Binary payloads are base64 (standard alphabet, padded):
- `image`: a PNG file.
- `audio`: raw little-endian PCM, channels interleaved; `encoding` says `f32le` (float32 in [-1, 1],
  what the server sends) or `s16le`.
- `video`: an MP4 file (H.264; AAC when it carries sound).

Array outputs (`action` chunks for robot actions, `tensor` chunks for latents and other arrays) carry
`dtype`, `shape` and their row-major values in the form the request's `encoding` asks:
- `"auto"` (the default): actions as `"json"` (a few hundred numbers a chunk), tensors as `"binary"`
  (latents run to millions of values).
- `"json"`: `values`, a flat list of JSON numbers, exact for the dtype (float32 written as
  the float64 it widens to); NaN and infinities as the strings "NaN", "Infinity", "-Infinity".
- `"binary"`: `data`, the base64 of the raw little-endian bytes of the C-contiguous array (4/3 the raw
  size, against about 20 characters a value for JSON numbers; decoding is a copy, not a parse).
A request's `tensor_dtype` (`"float32"` or `"bfloat16"`) sends float `tensor` chunks in that dtype (action
chunks stay float32): bfloat16 values are rounded to nearest even, and their bytes are the top two bytes of
each float32 (`mstar.server.array_codec`).
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from mstar.server.array_codec import base64_length, from_raw, itemsize, raw_bytes, to_bfloat16, torch_from_raw

MAX_TOKENS_LIMIT = 1 << 20  # upper bound for any token-count field
MAX_SEED = 2**63 - 1
_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
TENSOR_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")


class Usage(BaseModel):
    """Token counts of one request; `total_tokens` defaults to the sum of the other two."""

    prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)
    total_tokens: int = Field(-1, ge=-1)

    @model_validator(mode="after")
    def _fill_total(self) -> Usage:
        if self.total_tokens < 0:
            self.total_tokens = self.prompt_tokens + self.completion_tokens
        return self


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """The body of every non-2xx answer, native and OpenAI routes alike: `{"error": {...}}`."""

    error: ErrorDetail


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_response(status: int, message: str, param: str | None = None) -> ErrorResponse:
    """The error body for HTTP `status`, typed the way OpenAI clients expect."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=status))


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """A short human message and the offending parameter for a pydantic `ValidationError`.

    Deepest errors come first (they name the exact field); at most three are listed.
    """
    items = []
    for err in exc.errors(include_url=False):
        # Drop union-branch labels ("str", "list[...]", "tagged-union[...]") from the location.
        loc: list[str] = []
        for part in err["loc"]:
            # Drop union-branch labels ("str", "list[...]") and a discriminator tag that repeats the
            # field after it ("image_url.image_url.url" -> "image_url.url").
            if isinstance(part, str) and ("[" in part or part in ("str", "int")):
                continue
            if not (loc and loc[-1] == str(part)):
                loc.append(str(part))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] not in ("missing", "model_type") and "input" in err and not isinstance(
            err["input"], dict | list
        ) and repr(err["input"]) not in msg:  # a validator's own message may already quote it
            msg += f" (got {err['input']!r})"
        items.append((loc, msg))
    items.sort(key=lambda item: -len(item[0]))
    seen: list[str] = []
    for loc, msg in items:
        text = f"{'.'.join(loc)}: {msg}" if loc else msg
        if text not in seen:
            seen.append(text)
    param = ".".join(items[0][0]) if items and items[0][0] else None
    return "; ".join(seen[:3]), param


class MediaPart(BaseModel):
    """One media input of a /generate request."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["image", "audio", "video"]
    data: str = Field(min_length=1)  # data URL, base64, or http(s) URL when the server allows remote media
    format: str | None = None  # a hint such as "wav" or "png"; the bytes decide
    name: str | None = Field(None, pattern=_NAME)  # the model input it feeds, when a model has several


class GenerateRequest(BaseModel):
    """`POST /generate` body: inputs, wanted outputs and per-request model options."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = None
    media: list[MediaPart] = Field(default_factory=list, max_length=64)
    outputs: list[str] = Field(default_factory=lambda: ["text"], min_length=1, max_length=16)
    options: dict[str, Any] = Field(default_factory=dict)  # sampling and model knobs, e.g. max_tokens
    request_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:\-]{1,128}$")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = True
    encoding: Literal["auto", "json", "binary"] = "auto"  # how action and tensor chunks carry values (module doc)
    tensor_dtype: Literal["float32", "bfloat16"] | None = None  # float tensor chunks' dtype; None: the output's

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        if self.text is None and not self.media:
            raise ValueError("a request needs `text` or at least one `media` part")
        return self._check_outputs()

    def _check_outputs(self) -> GenerateRequest:
        if len(set(self.outputs)) != len(self.outputs):
            raise ValueError(f"outputs must be distinct, got {self.outputs}")
        for name in self.outputs:
            if not name or len(name) > 64:
                raise ValueError(f"output names must be 1-64 characters, got {name!r}")
        return self


class GenerateForm(GenerateRequest):
    """The text fields of a multipart `POST /generate`: like GenerateRequest, but the media arrive as
    file parts, so "text or media" is checked by the route once it has seen the files."""

    @model_validator(mode="after")
    def _check(self) -> GenerateForm:
        return self._check_outputs()


class _Chunk(BaseModel):
    model_config = ConfigDict(extra="forbid")

    output: str  # the output this chunk belongs to (e.g. "text", "audio")
    seq: int = Field(ge=0)  # per-output sequence number: 0, 1, 2, ... without gaps


class TextChunk(_Chunk):
    """New text of an output."""

    type: Literal["text"] = "text"
    delta: str

    @property
    def text(self) -> str:
        """The new text (`delta`), named as on a streamed chat event."""
        return self.delta


class ImageChunk(_Chunk):
    """One image, PNG."""

    type: Literal["image"] = "image"
    data: str
    width: int = Field(ge=1)
    height: int = Field(ge=1)

    def png_bytes(self) -> bytes:
        return base64.b64decode(self.data)

    def to_pil(self):
        """The image as a `PIL.Image.Image` (needs Pillow)."""
        import io

        from PIL import Image

        return Image.open(io.BytesIO(self.png_bytes()))


class AudioChunk(_Chunk):
    """A piece of PCM audio (see the module docstring for the layout)."""

    type: Literal["audio"] = "audio"
    data: str
    sample_rate: int = Field(ge=1)
    channels: int = Field(1, ge=1, le=8)
    encoding: Literal["f32le", "s16le"] = "f32le"

    @classmethod
    def from_array(cls, output: str, seq: int, samples: np.ndarray, sample_rate: int) -> AudioChunk:
        """Build from float audio shaped (frames,) or (frames, channels)."""
        arr = np.asarray(samples, dtype="<f4")
        channels = 1 if arr.ndim == 1 else arr.shape[1]
        data = base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode()
        return cls(output=output, seq=seq, data=data, sample_rate=sample_rate, channels=channels)

    def to_numpy(self) -> np.ndarray:
        """float32 samples shaped (frames, channels)."""
        raw = base64.b64decode(self.data)
        if self.encoding == "s16le":
            arr = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
        else:
            arr = np.frombuffer(raw, "<f4").astype(np.float32)
        return arr.reshape(-1, self.channels)


class VideoChunk(_Chunk):
    """A video, MP4."""

    type: Literal["video"] = "video"
    data: str
    fps: float = Field(gt=0)
    frames: int = Field(ge=1)

    def mp4_bytes(self) -> bytes:
        return base64.b64decode(self.data)


class _ArrayChunk(_Chunk):
    """An array of `dtype` and `shape`: row-major `values` (encoding "json") or base64 raw little-endian
    `data` (encoding "binary"), exactly one of them (see the module docstring)."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    dtype: str
    shape: list[Annotated[int, Field(ge=0)]]
    values: list[float | int] | None = None
    data: str | None = None

    @model_validator(mode="after")
    def _check_size(self) -> _ArrayChunk:
        count = int(np.prod(self.shape))
        if (self.values is None) == (self.data is None):
            raise ValueError("an array chunk carries exactly one of `values` and `data`")
        if self.values is not None and len(self.values) != count:
            raise ValueError(f"shape {self.shape} does not hold {len(self.values)} values")
        if self.data is not None and len(self.data) != base64_length(count * itemsize(self.dtype)):
            raise ValueError(f"data is not the base64 of {count} {self.dtype} values of shape {self.shape}")
        return self

    @classmethod
    def from_array(cls, output: str, seq: int, array: np.ndarray, binary: bool, dtype: str | None = None):
        """The chunk of `array` in `dtype` (default: its own), as bytes when `binary`, else as numbers."""
        arr = np.asarray(array)
        dtype = dtype or str(arr.dtype)
        fields = {"output": output, "seq": seq, "dtype": dtype, "shape": list(arr.shape)}
        if binary:
            return cls(**fields, data=base64.b64encode(raw_bytes(arr, dtype)).decode())
        values = to_bfloat16(arr) if dtype == "bfloat16" else arr.astype(dtype, copy=False)
        return cls(**fields, values=values.reshape(-1).tolist())

    def to_numpy(self) -> np.ndarray:
        """The array (bfloat16 comes back as float32 holding the same values: numpy has no bfloat16)."""
        if self.data is not None:
            return from_raw(base64.b64decode(self.data), self.dtype, self.shape)
        return np.asarray(self.values, np.float32 if self.dtype == "bfloat16" else self.dtype).reshape(self.shape)

    def to_torch(self):
        """The array as a `torch.Tensor` of `dtype` itself (bfloat16 stays bfloat16; needs torch)."""
        raw = base64.b64decode(self.data) if self.data is not None else raw_bytes(self.to_numpy(), self.dtype)
        return torch_from_raw(raw, self.dtype, self.shape)


class ActionChunk(_ArrayChunk):
    """Robot actions of `shape` (e.g. [horizon, action_dim]), float32."""

    type: Literal["action"] = "action"
    dtype: Literal["float32"] = "float32"


class TensorChunk(_ArrayChunk):
    """Any other array output (latents, pooled features, logits, progress)."""

    type: Literal["tensor"] = "tensor"
    dtype: Literal[TENSOR_DTYPES]  # type: ignore[valid-type]


class TopLogprob(BaseModel):
    """One token's log-probability, as OpenAI names it: its text, and its exact UTF-8 bytes (a token may hold
    part of a character, whose text is then U+FFFD)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """A generated token's log-probability and its most likely alternatives (chat's `logprobs.content` item)."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class LogprobsChunk(_Chunk):
    """One generated token's log-probability and alternatives (option `logprobs`, output "logprobs"), as
    OpenAI chat's `logprobs.content`; it comes just before the text chunk that carries the token's text (a token
    whose text is held back, part of a character or of a possible stop string, waits for that chunk)."""

    type: Literal["logprobs"] = "logprobs"
    content: list[TokenLogprob]


class ErrorChunk(BaseModel):
    """The request failed after streaming began. Clients must raise, never show it as output."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["error"] = "error"
    status: int = Field(ge=400, le=599)
    message: str
    output: str | None = None


class FinalChunk(BaseModel):
    """The last chunk of a successful stream."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["final"] = "final"
    request_id: str | None = None
    finish_reason: str  # "stop", "length", ...
    usage: Usage = Field(default_factory=Usage)


OutputChunk = TextChunk | ImageChunk | AudioChunk | VideoChunk | ActionChunk | TensorChunk | LogprobsChunk
StreamChunk = Annotated[OutputChunk | ErrorChunk | FinalChunk, Field(discriminator="type")]
_CHUNK = TypeAdapter(StreamChunk)


def parse_chunk(line: str | bytes) -> OutputChunk | ErrorChunk | FinalChunk:
    """Parse one NDJSON line into its chunk type (raises pydantic's ValidationError)."""
    return _CHUNK.validate_json(line)


# JSON leaves these raw inside strings, but Python's splitlines (and so httpx's iter_lines) breaks lines on
# them: a model that samples one would otherwise split its own stream frame in two.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def one_line(text: str) -> bytes:
    """`text` (serialized JSON) encoded with the Unicode line breaks escaped, so it frames as one line anywhere."""
    # isascii reads a flag CPython keeps: base64 payloads of megabytes skip the per-character pass
    return (text if text.isascii() else text.translate(_LINE_BREAKS)).encode()


def chunk_line(chunk: BaseModel) -> bytes:
    """One NDJSON line for `chunk`, newline-terminated."""
    return one_line(chunk.model_dump_json(exclude_none=True)) + b"\n"


class GenerateResponse(BaseModel):
    """A non-streaming /generate answer: every output's chunks in order, then how it ended."""

    model_config = ConfigDict(ser_json_inf_nan="strings")  # the array chunks' non-finite numbers, nested
    request_id: str | None = None
    outputs: dict[str, list[Annotated[OutputChunk, Field(discriminator="type")]]]
    finish_reason: str
    usage: Usage = Field(default_factory=Usage)
