"""What `MStarClient` and `AsyncMStarClient` share: their settings, the httpx client they hold and how a
sent call's answer becomes its result or an `MStarError`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

import httpx

from mstar.client import endpoints
from mstar.client.endpoints import Call
from mstar.client.errors import error_from_body

HttpT = TypeVar("HttpT", httpx.Client, httpx.AsyncClient)


class ClientBase(Generic[HttpT]):
    """The default model and the httpx client, built from the server's URL, key and timeout unless given."""

    http_class: ClassVar[Callable[..., Any]]  # httpx.Client or httpx.AsyncClient

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: float = 600.0,
        model: str | None = None,
        http_client: HttpT | None = None,
    ):
        self.model = model
        self._http: HttpT = http_client or self.http_class(**endpoints.client_settings(base_url, api_key, timeout))


def answer(call: Call, resp: httpx.Response) -> Any:
    """`call`'s result read from `resp`; an HTTP error status raises `MStarError` with the server's message."""
    if resp.status_code >= 400:
        raise error_from_body(resp.status_code, resp.content)
    return call.read(resp)
