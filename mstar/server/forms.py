"""Multipart (and JSON-or-multipart) request bodies for the media routes.

Routes that take uploads read the form here: text fields become a dict validated by the route's
pydantic model (a field sent several times, or as `name[]` the way the openai client sends
arrays, becomes a list); file parts are read under the server's `MediaPolicy` size limit and typed
by their Content-Type. Every mistake raises `RequestError` (400, 413 or 415) with a message naming
the field.
"""

from __future__ import annotations

import json
import mimetypes
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile

from mstar.server.adapters import RequestError
from mstar.server.media import MediaPolicy, load_media_bytes
from mstar.server.protocol import validation_message

M = TypeVar("M", bound=BaseModel)
MODALITIES = ("image", "audio", "video")
MAX_FORM_FILES = 64
_READ_CHUNK = 1 << 20


def content_type(request: Request) -> str:
    """The request's media type, lower case, without parameters ("" when absent)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def is_form(request: Request) -> bool:
    """True for multipart/form-data and urlencoded bodies."""
    return content_type(request) in ("multipart/form-data", "application/x-www-form-urlencoded")


async def read_form(request: Request) -> FormData:
    """The parsed form; 415 when the body is not a form. Malformed multipart answers 400 (Starlette)."""
    if not is_form(request):
        raise RequestError(415, f"this route takes multipart/form-data, got content type "
                                f"{content_type(request) or 'none'!r}")
    return await request.form(max_files=MAX_FORM_FILES, max_fields=256)


def text_fields(form: FormData) -> dict[str, Any]:
    """The non-file fields: repeated names and `name[]` become lists, single ones stay strings."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys(form.keys()):
        values = [v for v in form.getlist(key) if isinstance(v, str)]
        if not values:
            continue
        name = key.removesuffix("[]")
        out[name] = values if key.endswith("[]") or len(values) > 1 else values[0]
    return out


def refuse_stray_files(form: FormData, route: str, names: tuple[str, ...], hint: str = "") -> None:
    """400 naming a file part sent under none of `names` (or `name[]`): the route would drop it unread."""
    stray = [k for k, v in form.multi_items() if isinstance(v, UploadFile) and k.removesuffix("[]") not in names]
    if stray:
        raise RequestError(400, f"file part {stray[0]!r}: {route} takes files as {', '.join(names)}"
                                + (f"; {hint}" if hint else ""), stray[0])


def files_of(form: FormData, *names: str) -> list[UploadFile]:
    """The file parts sent under any of `names` (or `name[]`), in order."""
    wanted = {n for name in names for n in (name, f"{name}[]")}
    return [v for k, v in form.multi_items() if k in wanted and isinstance(v, UploadFile)]


def validate(cls: type[M], data: Any) -> M:
    """`cls` validated from a dict; pydantic errors become RequestError(400) naming the field."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise RequestError(400, message or "invalid request", param) from None


async def json_or_form(request: Request, cls: type[M], file_fields: tuple[str, ...] = ()
                       ) -> tuple[M, FormData | None]:
    """Validate a JSON body, or a form's text fields, as `cls`; the form too when there was one.

    Fields named in `file_fields` are left out of validation when they arrive as file parts.
    """
    if is_form(request):
        form = await read_form(request)
        refuse_stray_files(form, request.url.path, file_fields)
        data = {k: v for k, v in text_fields(form).items() if k not in file_fields or not files_of(form, k)}
        return validate(cls, data), form
    if content_type(request) not in ("application/json", ""):
        raise RequestError(415, f"send application/json or multipart/form-data, got {content_type(request)!r}")
    return await read_json(request, cls), None


async def read_json(request: Request, cls: type[M]) -> M:
    """Validate a JSON body as `cls`, read from the body's stream so its bytes are freed once parsed
    (FastAPI's own body parameter keeps them, and the parsed dict, for the whole request)."""
    raw = b"".join([chunk async for chunk in request.stream()])
    try:
        data = json.loads(raw) if raw else None
    except ValueError as exc:
        raise RequestError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestError(400, "the body's JSON is nested too deeply") from None
    del raw  # the parsed body is all the route needs: the bytes are not held beside it
    if not isinstance(data, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(data).__name__}")
    return validate(cls, data)


def json_body(cls: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` documenting a JSON body of `cls`, for routes that read it with `read_json`."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline_schema(cls)}}}}


async def upload_bytes(upload: UploadFile, field: str, policy: MediaPolicy) -> bytes:
    """The bytes of one file part, refused with 413 past `policy.max_bytes` and 400 when empty."""
    buf = bytearray()
    while chunk := await upload.read(_READ_CHUNK):
        buf.extend(chunk)
        if len(buf) > policy.max_bytes:
            raise RequestError(413, f"file {upload.filename!r} in field {field!r} is over the limit of "
                                    f"{policy.max_bytes} bytes", field)
    if not buf:
        raise RequestError(400, f"file {upload.filename!r} in field {field!r} is empty", field)
    return bytes(buf)


def upload_modality(upload: UploadFile, field: str) -> str:
    """image, audio or video from the part's Content-Type (or its file name when the type is
    generic); 415 for anything else."""
    kind = (upload.content_type or "").split(";")[0].strip().lower()
    if kind in ("", "application/octet-stream"):
        kind = mimetypes.guess_type(upload.filename or "")[0] or kind
    major = kind.split("/")[0]
    if major in MODALITIES:
        return major
    raise RequestError(415, f"file {upload.filename!r} in field {field!r} has media type {kind or 'none'!r}; "
                            f"send image/*, audio/* or video/* (or a file name with a known extension)", field)


async def media_bytes(value: UploadFile | str, field: str, policy: MediaPolicy) -> bytes:
    """A media field sent as a file part or as text (data URL or base64; a URL only when the policy
    allows remote media): its bytes, size-checked."""
    if isinstance(value, UploadFile):
        return await upload_bytes(value, field, policy)
    return await run_in_threadpool(load_media_bytes, value, policy)


def form_options(extra: dict[str, Any]) -> dict[str, Any]:
    """Extra form fields as model options: form values are strings, so JSON literals ("5", "false",
    "[1, 2]") become numbers, booleans and lists; anything else stays a string."""
    out = {}
    for key, value in extra.items():
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                pass
        out[key] = value
    return out


def inline_schema(cls: type[BaseModel]) -> dict[str, Any]:
    """The JSON schema of `cls` with its `$defs` inlined, fit for an OpenAPI `openapi_extra` body
    (where `#/$defs/...` references would not resolve). Models must not be recursive."""
    schema = cls.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)
