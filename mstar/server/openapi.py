"""The app's OpenAPI document, made to say what the server really answers.

FastAPI documents a 422 validation error per operation; this server answers bad input (body or
parameters) with 400 and the OpenAI error body (app.py), refuses oversized bodies with 413, bodies
of the wrong media type on form routes with 415, missing keys with 401, other models and
unsupported routes with 404, a full queue with 429 and no live worker with 503. `install_openapi` swaps the 422 for those,
each with the `ErrorResponse` schema, so clients and schema-driven tests
(tests/e2e/test_schemathesis.py) see the real contract. Routes document their own success
content types (e.g. NDJSON or SSE streams) and route-specific errors (`errors(...)`) with
`responses=` on the route.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from mstar.server.protocol import ErrorResponse

_ERROR_REF = "#/components/schemas/ErrorResponse"
_DESCRIPTIONS = {
    "400": "invalid request (body, parameters or options the model refuses)",
    "401": "missing or wrong API key",
    "404": "another model's name, or a route this model cannot serve",
    "409": "the resource is not in a state that allows this (e.g. a video job not completed yet)",
    "413": "request body over the size limit",
    "415": "request body of a media type this route does not take",
    "429": "server busy (queue full, or too many jobs kept): retry after the Retry-After seconds",
    "503": "no live worker can serve it, or the server is stopping",
}

# `responses=` content entries for streamed and binary success bodies.
# Before OpenAPI 3.2, the `schema` of text/event-stream describes one event (its fields), not the stream.
SSE = {"schema": {"type": "object", "required": ["data"], "description": "one server-sent event",
                  "properties": {"data": {"type": "string", "description": "a JSON object, or [DONE] last"},
                                 "event": {"type": "string"}}}}
BINARY = {"schema": {"type": "string", "format": "binary"}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for a route's own error statuses, each with the `ErrorResponse` body."""
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS.get(str(status), "error")}
            for status in statuses}


def _error(status: str) -> dict[str, Any]:
    return {"description": _DESCRIPTIONS.get(status, "error"),
            "content": {"application/json": {"schema": {"$ref": _ERROR_REF}}}}


def _document(schema: dict[str, Any], api_key: bool) -> dict[str, Any]:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.setdefault("ErrorResponse", ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}"))
    for defs_name, defs in components["ErrorResponse"].pop("$defs", {}).items():
        components.setdefault(defs_name, defs)
    for path, operations in schema.get("paths", {}).items():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            statuses = ["401"] if api_key and path != "/health" else []
            body = op.get("requestBody")
            if body is not None:
                statuses += ["400", "404", "413", "429", "503"]
                if "multipart/form-data" in body.get("content", {}):  # forms.py refuses other media types
                    statuses.append("415")
            elif op.get("parameters"):  # a bad path or query parameter
                statuses.append("400")
            for status in statuses:
                responses.setdefault(status, _error(status))
    for name in ("HTTPValidationError", "ValidationError"):  # only the dropped 422 used them
        components.pop(name, None)
    return schema


def install_openapi(app: FastAPI, api_key: bool) -> None:
    """Make `app.openapi()` return the corrected document (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            app.openapi_schema = _document(schema, api_key)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
