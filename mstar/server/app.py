"""The HTTP server: `create_app(runtime)` builds the FastAPI app over a running `Runtime`.

Routes live in `routes_native` (/generate, /health, /ready, /metrics), `routes_openai` (models, chat,
completions), `routes_media` (speech, images), `routes_transcriptions`, `routes_videos` and, with `ui`,
`routes_playground` (the page at `/`). Every error body is `{"error": {...}}`; bad input answers 4xx, never 5xx.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from mstar.server.adapters import RequestError
from mstar.server.media import MediaError, MediaPolicy, warm_encoders
from mstar.server.metrics import ServerMetrics
from mstar.server.middleware import GuardMiddleware
from mstar.server.openapi import install_openapi
from mstar.server.protocol import error_response, validation_message

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What every route needs: the runtime, its metrics and the media policy (`policy(route)`)."""

    runtime: Any
    metrics: ServerMetrics
    media_policy: MediaPolicy  # every route's, but those in `route_policies`
    model_name: str
    route_policies: dict[str, MediaPolicy] = field(default_factory=dict)

    def policy(self, route: str) -> MediaPolicy:
        """The media policy of `route` (its path as the app declares it)."""
        return self.route_policies.get(route, self.media_policy)

    def check_model(self, requested: str | None, needs: str | None = None, route: str = "") -> None:
        """Raise RequestError(404) for another model's name or a route this model cannot serve."""
        if requested not in (None, "", "default", self.model_name):
            raise RequestError(404, f"model {requested!r} is not served here; this server serves "
                                    f"{self.model_name!r} (see GET /v1/models)", param="model")
        outputs = self.runtime.model.output_modalities
        if needs is not None and needs not in outputs:
            raise RequestError(404, f"{route} is not available for model {self.model_name!r}: it needs {needs} "
                                    f"output, and the model produces {', '.join(outputs)}")


def error_json(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    """A JSONResponse with the standard error body."""
    return JSONResponse(error_response(status, message, param).model_dump(), status_code=status, headers=headers)


class _ValidationShim:
    """Lets `validation_message` read FastAPI's RequestValidationError (a list of pydantic errors)."""

    def __init__(self, errors: list[dict]) -> None:
        self._errors = errors

    def errors(self, include_url: bool = False) -> list[dict]:
        return [{**e, "loc": tuple(e.get("loc", ()))[1:] if e.get("loc", ("",))[0] == "body" else e.get("loc", ())}
                for e in self._errors]


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(_ValidationShim(list(exc.errors())))  # type: ignore[arg-type]
        return error_json(400, message or "invalid request body", param)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_json(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(MediaError)
    async def _media_error(request: Request, exc: MediaError) -> JSONResponse:
        return error_json(exc.status_code, exc.message)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}; see /docs for the API"
        return error_json(exc.status_code, message, headers=getattr(exc, "headers", None))


@asynccontextmanager
async def _warm_lifespan(app: FastAPI):
    """Before the first request is accepted, in the worker-thread pool that requests build their inputs in
    (its first use imports and starts anyio's thread backend): the request path's one-time work
    (`_warm_request_path`)."""
    await run_in_threadpool(_warm_request_path, app.state.mstar.runtime)
    yield


def _warm_request_path(runtime: Any) -> None:
    """The processor's one-time work (`Processor.warm`: tokenizer, chat templates), then the encoders of
    the model's output media (`warm_encoders`: codec libraries' first use). A failure is logged; the
    first requests then pay for it."""
    try:
        runtime.processor.warm()
    except Exception:
        logger.warning("warming the request path failed; the first requests pay for it", exc_info=True)
    took = warm_encoders(runtime.model.output_modalities, runtime.processor.sample_rate)
    if took:
        logger.info("encoders warmed in %.0f ms (%s)", 1e3 * sum(took.values()), ", ".join(took))


def create_app(runtime: Any, api_key: str | None = None, media_policy: MediaPolicy | None = None,
               max_body_bytes: int | None = None, model_name: str | None = None,
               body_timeout_s: float | None = None, ui: bool = False) -> FastAPI:
    """The app serving `runtime`. With `api_key`, every route but /health and the playground's files needs
    `Authorization: Bearer`. With `ui`, the playground page answers at `/` (routes_playground)."""
    from mstar.server import (
        routes_media,
        routes_native,
        routes_openai,
        routes_openpi,
        routes_playground,
        routes_transcriptions,
        routes_videos,
    )

    metrics = ServerMetrics(runtime)
    limits = runtime.config.limits  # the arguments override the config's `limits` (tests use them)
    state = ServerState(runtime, metrics, media_policy or MediaPolicy.from_limits(limits),
                        model_name or getattr(runtime.model, "name", None) or runtime.config.model,
                        {route: MediaPolicy.from_limits(limits.for_route(route)) for route in limits.routes})
    app = FastAPI(title="mstar", version="0.1.0", lifespan=_warm_lifespan,
                  description=f"Serving {state.model_name}: native /generate and OpenAI-compatible routes.")
    app.state.mstar = state
    app.state.api_key = api_key  # the websocket routes check it themselves (GuardMiddleware sees HTTP only)
    install_openapi(app, api_key=api_key is not None)
    _install_error_handlers(app)
    app.include_router(routes_native.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_media.router)
    app.include_router(routes_transcriptions.router)
    app.include_router(routes_videos.router)
    app.include_router(routes_openpi.router)
    if ui:
        routes_playground.install_playground(app)
    if limits.routes:
        _check_limit_routes(app, limits, runtime.config.source)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes or limits.max_body_bytes,
                       metrics=metrics, body_timeout_s=body_timeout_s or limits.body_timeout_s)
    return app


def _check_limit_routes(app: FastAPI, limits, source: str) -> None:
    """Refuse `limits.routes` keys that name no route taking a body (read from the OpenAPI document,
    which lists every included route)."""
    from mstar.config import ConfigError

    paths = sorted(path for path, ops in app.openapi()["paths"].items() if "post" in ops)
    unknown = sorted(set(limits.routes) - set(paths))
    if unknown:
        raise ConfigError(f"{source}: limits.routes names {unknown}, which take no input here; routes that do: "
                          f"{', '.join(paths)}")


def get_state(request: Request) -> ServerState:
    """The ServerState of the app handling `request`."""
    return request.app.state.mstar
