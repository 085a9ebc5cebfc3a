"""Pure ASGI middleware (no BaseHTTPMiddleware: it would hide client disconnects from handlers).

`GuardMiddleware` enforces the bearer token, caps request bodies, counts responses per route and
answers any unhandled error with a counted 500.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import logging
import tempfile
import uuid
from typing import Any

from starlette.exceptions import HTTPException

from mstar.server.protocol import error_response

logger = logging.getLogger(__name__)
# "METHOD /route" of the request the current task serves, for the request log (server/adapters.py)
REQUEST_ROUTE: contextvars.ContextVar[str] = contextvars.ContextVar("mstar_request_route", default="-")
OPEN_PATHS = ("/health", "/")  # reachable without the API key (load balancer probes; the playground page)
OPEN_PREFIX = "/playground/"  # the playground's static files, which hold no data; its requests send the key


async def send_error(send, status: int, message: str, headers: list | None = None) -> None:
    """Answer with the standard `{"error": {...}}` body."""
    body = json.dumps(error_response(status, message).model_dump()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(HTTPException):
    """Raised from `receive`; an HTTPException so FastAPI's body parsing passes it through as a 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is over the limit of {limit} bytes")


class _BodyTimeout(HTTPException):
    """Raised from `receive` when a client stops sending a body it declared; answered as a 408."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body stopped arriving for {timeout_s:g} s")


SPOOL_BYTES = 1024 * 1024  # a larger body is read to its end on disk before the route runs
_REPLAY_CHUNK = 64 * 1024


class _SpooledBody:
    """A request body read to its end before the app runs, kept on disk past SPOOL_BYTES, so a slow
    upload holds a file rather than memory; the app then receives it again in chunks."""

    def __init__(self) -> None:
        self.file = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
        self.size = 0

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.size += len(data)

    def close(self) -> None:
        self.file.close()

    def replay(self, receive):
        """A `receive` that gives the spooled body, then passes on to `receive` (disconnects)."""
        self.file.seek(0)
        done = False

        async def replayed():
            nonlocal done
            if done:
                return await receive()
            chunk = self.file.read(_REPLAY_CHUNK)
            done = self.file.tell() >= self.size
            if done:
                self.close()
            return {"type": "http.request", "body": chunk, "more_body": not done}

        return replayed


class GuardMiddleware:
    """API key check (every path but /health), body size limit and read timeout, response counting."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: Any, body_timeout_s: float) -> None:
        self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        REQUEST_ROUTE.set(f"{scope.get('method', '')} {_route(path)}")
        if self.api_key and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIX) and not self._authorized(scope):
            self.metrics.http_response(_route(path), 401)
            await send_error(send, 401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                             [(b"www-authenticate", b"Bearer")])
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            self.metrics.http_response(_route(path), 413)
            await send_error(send, 413, f"request body is {int(length)} bytes, over the limit of "
                                        f"{self.max_body_bytes} bytes")
            return
        declared = int(length) if length is not None and length.isdigit() else None
        if scope.get("method") in ("POST", "PUT", "PATCH") and (declared is None or declared > SPOOL_BYTES):
            try:
                spooled = await self._spool(receive)
            except (_TooLarge, _BodyTimeout) as exc:
                self.metrics.http_response(_route(path), exc.status_code)
                await send_error(send, exc.status_code, exc.detail)
                return
            if spooled is None:  # the client left while sending
                return
            receive = spooled.replay(receive)
        await self._call_capped(scope, receive, send, path)

    async def _spool(self, receive) -> _SpooledBody | None:
        """The whole body, read under the size cap and the read timeout; None if the client left."""
        body = _SpooledBody()
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), self.body_timeout_s)
                except TimeoutError:
                    raise _BodyTimeout(self.body_timeout_s) from None
                if message["type"] == "http.disconnect":
                    body.close()
                    return None
                body.write(message.get("body", b""))
                if body.size > self.max_body_bytes:
                    raise _TooLarge(self.max_body_bytes)
                if not message.get("more_body", False):
                    return body
        except BaseException:
            body.close()
            raise

    async def _call_capped(self, scope, receive, send, path: str) -> None:
        received = 0
        started = body_done = False

        async def capped_receive():
            nonlocal received, body_done
            if body_done:  # later reads wait for a disconnect, which may rightly take long
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except TimeoutError:
                raise _BodyTimeout(self.body_timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_body_bytes:
                    raise _TooLarge(self.max_body_bytes)
            return message

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.http_response(_route(path), message["status"])
            await send(message)

        try:
            await self.app(scope, capped_receive, counting_send)
        except (_TooLarge, _BodyTimeout) as exc:  # raised where the route itself did not read the body
            if not started:
                await send_error(counting_send, exc.status_code, exc.detail)
        except Exception:  # answered and counted here, logged once; the connection stays usable
            error_id = uuid.uuid4().hex[:12]
            logger.exception("unhandled error %s on %s %s", error_id, scope.get("method"), path)
            if not started:
                await send_error(counting_send, 500, f"internal error {error_id} (the server log has its traceback)")

    def _authorized(self, scope) -> bool:
        value = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())


_KNOWN_ROUTES = frozenset((
    "/health", "/ready", "/metrics", "/generate", "/v1/models", "/v1/chat/completions", "/v1/completions",
    "/v1/audio/speech", "/v1/audio/transcriptions", "/v1/images/generations", "/v1/images/edits", "/v1/videos",
    "/v1/videos/generations"))


def _route(path: str) -> str:
    """A bounded label: known API paths as they are, a video job's paths with its id as `{video_id}`, a
    model's as `{model_id}`, anything else as 'other'."""
    if path in _KNOWN_ROUTES:
        return path
    parts = path.split("/")  # "", "v1", "videos", id[, "content"]
    if parts[1:3] == ["v1", "models"] and len(parts) == 4 and parts[3]:
        return "/v1/models/{model_id}"
    if parts[1:3] == ["v1", "videos"] and parts[3:4] and parts[3] and len(parts) <= 5:
        if len(parts) == 4:
            return "/v1/videos/{video_id}"
        if parts[4] == "content":
            return "/v1/videos/{video_id}/content"
    return "other"
