"""Request bodies and response parsing shared by the sync and async clients (no I/O here)."""

from __future__ import annotations

import base64
import json
import mimetypes
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from mstar.client.errors import MStarError
from mstar.server.protocol import ErrorChunk, FinalChunk, OutputChunk, parse_chunk
from mstar.server.protocol_openai_media import SAMPLE_RATE_HEADER  # noqa: F401 (re-exported for the clients)

DONE = object()  # the SSE "[DONE]" sentinel

_EXT_MODALITY = {
    ".png": "image", ".jpg": "image", ".jpeg": "image", ".webp": "image", ".gif": "image",
    ".wav": "audio", ".mp3": "audio", ".flac": "audio", ".ogg": "audio", ".opus": "audio",
    ".m4a": "audio", ".aac": "audio",
    ".mp4": "video", ".webm": "video", ".mov": "video", ".mkv": "video", ".avi": "video",
}
_MAGIC = (
    (b"\x89PNG", "image", "image/png"), (b"\xff\xd8\xff", "image", "image/jpeg"), (b"GIF8", "image", "image/gif"),
    (b"RIFF", None, None), (b"fLaC", "audio", "audio/flac"), (b"OggS", "audio", "audio/ogg"),
    (b"ID3", "audio", "audio/mpeg"), (b"\x1aE\xdf\xa3", "video", "video/webm"),
)


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def sniff(data: bytes) -> tuple[str, str]:
    """(modality, mime type) of media bytes, from their magic numbers."""
    if data[:4] == b"RIFF":
        kind = data[8:12]
        return ("image", "image/webp") if kind == b"WEBP" else ("audio", "audio/wav")
    if data[4:8] == b"ftyp":
        return ("audio", "audio/mp4") if data[8:11] == b"M4A" else ("video", "video/mp4")
    for magic, modality, mime in _MAGIC:
        if data.startswith(magic) and modality:
            return modality, mime
    if data[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2"):
        return "audio", "audio/mpeg"
    raise MStarError(0, "cannot tell the media type of these bytes; pass (filename, bytes) or a dict")


def media_part(item: Any) -> dict[str, Any]:
    """One /generate media part from a local path, bytes, (filename, bytes) or a ready dict.

    Local files are read here, on the client, and sent inline as data URLs.
    """
    if isinstance(item, dict):
        return item
    if isinstance(item, tuple) and len(item) == 2:
        name, data = item
        modality, mime = _by_name(str(name)) or sniff(data)
    elif isinstance(item, str | Path) and not str(item).startswith(("http://", "https://", "data:")):
        path = Path(item)
        if not path.is_file():
            raise MStarError(0, f"file not found: {path}")
        data = path.read_bytes()
        modality, mime = _by_name(path.name) or sniff(data)
    elif isinstance(item, str):  # a URL or data URL: the server decides whether it may fetch it
        return {"type": _url_modality(item), "data": item}
    elif isinstance(item, bytes | bytearray):
        data = bytes(item)
        modality, mime = sniff(data)
    else:
        raise TypeError(f"files entries must be paths, bytes, (name, bytes) or dicts, got {type(item).__name__}")
    return {"type": modality, "data": data_url(data, mime)}


def _by_name(name: str) -> tuple[str, str] | None:
    ext = Path(name).suffix.lower()
    if ext not in _EXT_MODALITY:
        return None
    return _EXT_MODALITY[ext], mimetypes.guess_type(name)[0] or "application/octet-stream"


def _url_modality(url: str) -> str:
    if url.startswith("data:"):
        kind = url[5:].split("/", 1)[0]
        if kind in ("image", "audio", "video"):
            return kind
    else:
        guess = _by_name(url.split("?")[0])
        if guess:
            return guess[0]
    raise MStarError(0, f"cannot tell the media type of {url[:60]!r}; pass {{'type': ..., 'data': ...}}")


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """A prompt string becomes one user message; a message list passes through."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if not isinstance(messages, list | tuple) or not all(isinstance(m, dict | BaseModel) for m in messages):
        raise TypeError(f"messages is a prompt string or a list of message dicts (or models), got {messages!r:.80}")
    return [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]


def ndjson_chunk(line: str | bytes) -> OutputChunk | FinalChunk | None:
    """Parse one NDJSON line; blank lines give None; an in-band error RAISES `MStarError`."""
    if not line.strip():
        return None
    try:
        chunk = parse_chunk(line)
    except ValueError as exc:
        raise MStarError(502, f"malformed stream line from the server: {exc}") from None
    if isinstance(chunk, ErrorChunk):
        raise MStarError(chunk.status, chunk.message)
    return chunk


def sse_event(line: str) -> Any:
    """The JSON payload of an SSE `data:` line, `DONE` for `[DONE]`, None for other lines.

    An event carrying an `error` object (or of type "error") RAISES `MStarError`.
    """
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return DONE
    try:
        event = json.loads(payload)
    except ValueError:
        raise MStarError(502, f"malformed SSE event from the server: {payload[:200]!r}") from None
    if isinstance(event, dict) and (event.get("type") == "error" or isinstance(event.get("error"), dict)):
        err = event.get("error") or {}
        status = err.get("code") if isinstance(err.get("code"), int) else 500
        raise MStarError(status, str(err.get("message") or event.get("message") or "error in stream"))
    return event


def generate_body(text, files, outputs, stream, options, seed, request_id, arrays=None) -> dict[str, Any]:
    """The /generate JSON body (see `mstar.server.protocol.GenerateRequest`); `arrays` are its `encoding` and
    `tensor_dtype` fields."""
    body: dict[str, Any] = {"outputs": list(outputs), "stream": stream, "options": dict(options), **(arrays or {})}
    if text is not None:
        body["text"] = text
    if files:
        body["media"] = [media_part(f) for f in ([files] if isinstance(files, str | bytes | Path) else files)]
    if seed is not None:
        body["seed"] = seed
    if request_id is not None:
        body["request_id"] = request_id
    return body


def image_from_b64(b64: str, as_bytes: bool):
    """Decoded image bytes, or a PIL image when `as_bytes` is false."""
    data = base64.b64decode(b64)
    if as_bytes:
        return data
    import io

    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def reference_url(item: Any) -> str | None:
    """`input_reference` for /v1/videos: a path or bytes become a data URL; strings pass through."""
    if item is None or (isinstance(item, str) and item.startswith(("http://", "https://", "data:"))):
        return item
    return media_part(item)["data"]


def check_job(job: dict[str, Any]) -> bool:
    """True when a video job completed; raises `MStarError` when it failed."""
    if job.get("status") == "failed":
        err = job.get("error") or {}
        raise MStarError(500, f"video job {job.get('id')} failed: {err.get('message', 'no reason given')}")
    return job.get("status") == "completed"


def media_file(item: Any, default_name: str = "file") -> tuple[str, bytes, str]:
    """(file name, bytes, mime type) of a local path, bytes or (filename, bytes), for multipart uploads."""
    if isinstance(item, tuple) and len(item) == 2:
        name, data = str(item[0]), bytes(item[1])
        mime = (_by_name(name) or sniff(data))[1]
        return name, data, mime
    if isinstance(item, str | Path):
        path = Path(item)
        if not path.is_file():
            raise MStarError(0, f"file not found: {path}")
        data = path.read_bytes()
        return path.name, data, (_by_name(path.name) or sniff(data))[1]
    if isinstance(item, bytes | bytearray):
        data = bytes(item)
        mime = sniff(data)[1]
        return f"{default_name}{mimetypes.guess_extension(mime) or ''}", data, mime
    raise TypeError(f"uploads must be paths, bytes or (name, bytes), got {type(item).__name__}")


def generate_form(text, files, outputs, stream, options, seed, request_id, arrays=None) -> tuple[dict[str, Any], list]:
    """The multipart /generate body: (text fields, file parts) for httpx's `data=` and `files=`."""
    data: dict[str, Any] = {"outputs": json.dumps(list(outputs)), "stream": json.dumps(stream),
                            "options": json.dumps(dict(options)), **(arrays or {})}
    if text is not None:
        data["text"] = text
    if seed is not None:
        data["seed"] = str(seed)
    if request_id is not None:
        data["request_id"] = request_id
    items = [files] if isinstance(files, str | bytes | Path) else list(files or ())
    return data, [("files", media_file(f)) for f in items]


def form_values(fields: dict[str, Any]) -> dict[str, str]:
    """Form text fields: None dropped, strings kept, everything else as JSON."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items() if v is not None}


def edit_form(prompt: str, images: Any, mask: Any, fields: dict[str, Any]) -> tuple[dict[str, str], list]:
    """The multipart /v1/images/edits body."""
    single = isinstance(images, str | bytes | Path) or (
        isinstance(images, tuple) and len(images) == 2 and isinstance(images[1], bytes | bytearray))
    items = [images] if single else list(images)
    files = [("image[]", media_file(img, "image")) for img in items]
    if mask is not None:
        files.append(("mask", media_file(mask, "mask")))
    return form_values({"prompt": prompt, "response_format": "b64_json", **fields}), files


def transcription_result(resp_body: bytes, response_format: str) -> Any:
    """`text` for json, the parsed object for verbose_json, the body text otherwise (text, srt, vtt)."""
    if response_format == "json":
        return json.loads(resp_body)["text"]
    if response_format == "verbose_json":
        return json.loads(resp_body)
    return resp_body.decode("utf-8")


def report_progress(job: dict[str, Any], on_progress: Any) -> None:
    """Call `on_progress(progress, status)` for a polled job, when a callback was given."""
    if on_progress is not None:
        on_progress(int(job.get("progress") or 0), str(job.get("status")))


def frame_parts(frames: Any, goal: Any = None) -> list[dict[str, Any]]:
    """/generate media parts of context frames (a video or image file as `media_part` takes it, a list of
    them, or uint8 arrays [H, W, 3] / [T, H, W, 3], sent as PNGs) and of a goal image, named "goal"."""
    parts = [media_part(item) for item in _frame_items(frames)]
    if goal is not None:
        goals = _frame_items(goal)
        if len(goals) != 1:
            raise ValueError(f"the goal is one image, got {len(goals)}")
        parts.append({**media_part(goals[0]), "name": "goal"})
    return parts


def _frame_items(frames: Any) -> list[Any]:
    if isinstance(frames, np.ndarray):
        return [png_bytes(f) for f in (frames[None] if frames.ndim == 3 else frames)]
    if isinstance(frames, str | bytes | bytearray | Path | tuple | dict):
        return [frames]
    return [png_bytes(f) if isinstance(f, np.ndarray) else f for f in frames]


def png_bytes(image: np.ndarray) -> bytes:
    """A uint8 [H, W, 3] array as PNG bytes."""
    import io

    from PIL import Image

    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [H, W, 3] arrays, got {image.dtype} {image.shape}")
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def numbers(rows: Any) -> list:
    """Nested lists of floats (robot states, actions) from lists or arrays."""
    return np.asarray(rows, dtype=np.float64).tolist()


def array_fields(encoding: str, tensor_dtype: str | None) -> dict[str, str]:
    """The /generate fields asking for array outputs in `encoding` ("json" or "binary"), float tensors in
    `tensor_dtype` ("float32", "bfloat16", or None for the outputs' own); the server checks them."""
    return {"encoding": encoding, **({"tensor_dtype": tensor_dtype} if tensor_dtype else {})}


def array_output(result: Any, name: str, as_torch: bool = False) -> Any:
    """The array of `result`'s (a GenerateResult) output `name` (a tensor or action chunk): numpy (bfloat16
    as float32), or with `as_torch` a torch tensor of the wire dtype (bfloat16 stays bfloat16)."""
    chunks = result.outputs.get(name)
    if not chunks:
        raise MStarError(502, f"the server sent no {name!r} output (got {sorted(result.outputs)})")
    return chunks[-1].to_torch() if as_torch else chunks[-1].to_numpy()
