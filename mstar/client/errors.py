"""The one exception the SDK raises for server-side failures."""

from __future__ import annotations

import json


class MStarError(Exception):
    """A request failed: `status` is the HTTP status (or the in-band one; 0 if the server was
    unreachable) and `message` the server's explanation."""

    def __init__(self, status: int, message: str):
        super().__init__(f"[{status}] {message}")
        self.status = status
        self.message = message


def error_from_body(status: int, body: bytes) -> MStarError:
    """Build the error for a non-2xx answer, keeping the server's message whatever its shape."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return MStarError(status, text or f"HTTP {status}")
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return MStarError(status, str(err["message"]))
        if isinstance(err, str):
            return MStarError(status, err)
        if "detail" in data:  # FastAPI's default error shape
            return MStarError(status, str(data["detail"]))
        if "message" in data:
            return MStarError(status, str(data["message"]))
    return MStarError(status, text)


def transport_error(exc: Exception, url: str, streaming: bool, timeout_s: float | None) -> MStarError:
    """The status-0 error for a request that got no HTTP answer: a read timeout (the server took the
    request and said nothing in time), or a connection that failed or broke."""
    import httpx

    if isinstance(exc, httpx.ReadTimeout):
        return MStarError(0, f"no answer from {url} within {timeout_s:g} s (the client's timeout)")
    return MStarError(0, f"stream from {url} broke: {exc}" if streaming else f"cannot reach {url}: {exc}")
