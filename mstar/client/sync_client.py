"""`MStarClient`: the blocking Python SDK over httpx."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from mstar.client import endpoints, wire
from mstar.client.base import ClientBase, answer
from mstar.client.endpoints import Call, StreamCall
from mstar.client.errors import error_from_body, transport_error


class MStarClient(ClientBase[httpx.Client]):
    """Talks to one mstar server. Every failure, HTTP or in-band in a stream, raises `MStarError`.

    The endpoint methods (`chat`, `generate`, `tts`, ...) are `ClientBase`'s. Streaming methods return
    iterators; leaving the loop early closes the connection.
    """

    http_class = httpx.Client

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MStarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------------

    def _run(self, call: Call | StreamCall) -> Any:
        """The result of a `Call`; for a `StreamCall`, the iterator of its items (sent at the first)."""
        return self._stream(call) if isinstance(call, StreamCall) else self._send(call)

    def _send(self, call: Call) -> Any:
        try:
            resp = self._http.request(call.method, call.path, **call.send)
        except httpx.TransportError as exc:
            raise transport_error(exc, f"{self._http.base_url}{call.path}", False, self._http.timeout.read) from None
        return answer(call, resp)

    def _stream(self, call: StreamCall) -> Iterator[Any]:
        try:
            with self._http.stream("POST", call.path, **call.send) as resp:
                if resp.status_code >= 400:
                    raise error_from_body(resp.status_code, resp.read())
                for line in resp.iter_lines():
                    item = call.item(line)
                    if item is wire.DONE:
                        return
                    if item is not None:
                        yield item
        except httpx.TransportError as exc:
            raise transport_error(exc, f"{self._http.base_url}{call.path}", True, self._http.timeout.read) from None

    def _answers(self, path: str) -> bool:
        try:
            return self._http.get(path).status_code == 200
        except httpx.TransportError:
            return False

    # -- endpoints that poll ----------------------------------------------------------------------

    def generate_video(
        self, prompt: str, seconds: float | None = None, size: str | None = None, input_reference: Any = None,
        poll_interval_s: float = 0.5, timeout_s: float | None = None,
        on_progress: Callable[[int, str], None] | None = None, **options: Any,
    ) -> bytes:
        """Text (or image) to video through the /v1/videos jobs API; returns MP4 bytes.

        Polls every `poll_interval_s`, calling `on_progress(percent, status)` after each poll; a failed
        job or one not done after `timeout_s` raises `MStarError`."""
        job = self._run(endpoints.create_video(prompt, seconds, size, input_reference, self.model, options))
        wait = endpoints.VideoWait(timeout_s, on_progress)
        while not wait.done(job):
            time.sleep(poll_interval_s)
            job = self._run(endpoints.video_job(job["id"]))
        return self._run(endpoints.video_content(job["id"]))
