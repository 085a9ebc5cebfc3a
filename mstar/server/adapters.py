"""Bridge the runtime (conductor thread, sink callbacks) to asyncio route handlers.

`start_request` validates, builds the walk inputs and submits; the returned `RequestStream` is an
async iterator of decoded `Item`s in arrival order. Closing a stream before it finished cancels the
request in the runtime, so a client that goes away never leaves work behind.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from mstar.conductor.request_state import FinishEvent, OutputEvent
from mstar.models.base import OptionError, check_option_support, check_option_types
from mstar.server.middleware import REQUEST_ROUTE
from mstar.server.protocol import Usage

logger = logging.getLogger(__name__)
request_log = logging.getLogger("mstar.server.requests")  # one line per ended request
RETRY_AFTER_S = 1  # what a 429 for a full queue asks the client to wait


class RequestError(Exception):
    """A request could not be started or failed; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


@dataclass(frozen=True)
class Item:
    """One decoded client value of output `name`; `seq` counts per output from 0."""

    name: str
    seq: int
    value: Any


class RequestStream:
    """One submitted request seen from asyncio. Iterate it for `Item`s; then read `finish_reason`
    and `usage`. A failed request raises `RequestError` from the iteration."""

    def __init__(self, state, rid: str, inputs: Mapping[str, Any], options: dict[str, Any]) -> None:
        self.state, self.rid = state, rid
        self.runtime = state.runtime
        self.decoder = self.runtime.processor.output_decoder(options, inputs)
        self.prompt_tokens = self.decoder.prompt_tokens or _count_prompt(inputs)
        self.finish_reason: str | None = None
        self.done = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._seq: dict[str, int] = {}
        self._t0 = time.monotonic()
        self._first: float | None = None  # seconds from submission to the first value of any output
        self.route = REQUEST_ROUTE.get()
        self._last: float | None = None
        self._last_of: dict[str, float] = {}  # output name -> arrival of its latest value

    def sink(self, event: OutputEvent | FinishEvent) -> None:
        """Called from the conductor thread: hand the event to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is closed (server shutting down): nobody is listening
            pass

    @property
    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.decoder.completion_tokens)

    async def __aiter__(self) -> AsyncIterator[Item]:
        try:
            while not self.done:
                event = await self._queue.get()
                for item in self._handle(event):
                    yield item
        finally:
            self.close()

    def _handle(self, event: OutputEvent | FinishEvent) -> list[Item]:
        if isinstance(event, FinishEvent):
            self.done = True
            self.decoder.end(event.streams)
            if event.error is not None:
                self._ended(self.finish_reason or event.finish_reason, event.status)
                raise RequestError(event.status if event.status >= 400 else 500, event.error)
            self.finish_reason = self.finish_reason or event.finish_reason or "stop"
            items = self._items(self.decoder.flush())
            self._ended(self.finish_reason, event.status)
            return items
        if self.finish_reason is not None:  # stopped by the decoder (stop string): drop the rest
            return []
        self._observe_timing(event.name)
        items = self._items(self.decoder.push(event.name, event.value))
        if self.decoder.finish_reason is not None:
            self.finish_reason = self.decoder.finish_reason
            self.runtime.cancel(self.rid)
        return items

    def _items(self, pairs: list[tuple[str, Any]]) -> list[Item]:
        out = []
        for name, value in pairs:
            seq = self._seq.get(name, 0)
            self._seq[name] = seq + 1
            out.append(Item(name, seq, value))
        return out

    def _observe_timing(self, output: str) -> None:
        now, metrics = time.monotonic(), self.state.metrics
        if self._last is None:
            self._first = now - self._t0
            metrics.first_output(self._first)
        else:
            metrics.inter_output(now - self._last)
        previous = self._last_of.get(output)
        if previous is None:
            metrics.first_of(output, now - self._t0)  # time to first token / audio / image / video
        else:
            metrics.inter_output(now - previous, output)
        self._last, self._last_of[output] = now, now

    def close(self) -> None:
        """Cancel the request if it has not finished (the client went away)."""
        if not self.done:
            self.done = True
            self._ended("cancelled", 499)
            self.runtime.cancel(self.rid)

    def _ended(self, finish_reason: str | None, status: int) -> None:
        """Count the request's end and its tokens, and log its line."""
        generated = self.decoder.completion_tokens
        self.state.metrics.finished(finish_reason, status, self.prompt_tokens, generated)
        first = "-" if self._first is None else f"{self._first:.3f}s"
        request_log.info("%s %s model=%s status=%d finish=%s prompt_tokens=%d output_tokens=%d "
                         "first_output=%s total=%.3fs", self.rid, self.route, self.state.model_name, status,
                         finish_reason or "none", self.prompt_tokens, generated, first, time.monotonic() - self._t0)

    async def collect(self) -> dict[str, list[Item]]:
        """Run to the end: every output's items, in order."""
        outputs: dict[str, list[Item]] = {}
        async for item in self:
            outputs.setdefault(item.name, []).append(item)
        return outputs


def _count_prompt(inputs: Mapping[str, Any]) -> int:
    """Prompt tokens when the decoder does not count them: the size of the `*_ids` inputs."""
    return sum(int(v.numel()) for k, v in inputs.items() if k.endswith("_ids") and hasattr(v, "numel"))


async def start_request(state, request: dict[str, Any], options: Mapping[str, Any],
                        rid: str | None = None, *, inputs_on_loop: bool = False) -> RequestStream:
    """Validate `options`, build the inputs (in a worker thread: tokenizing, media) and submit.
    `inputs_on_loop` builds them on the event loop instead, for requests whose inputs cost less than the
    two thread hand-offs (a robot's observation at the policy's sizes) and that wait on that latency.

    Raises RequestError: 400 for input the model refuses, the admission status when the server is busy.
    """
    from mstar.conductor.conductor import AdmissionError

    runtime = state.runtime
    try:
        check_option_support(state.model_name, runtime.processor, options)
        check_option_types(runtime.model.default_options, options)
        opts = runtime.model.request_options(dict(options))
        runtime.processor.validate_options(opts)
        if inputs_on_loop:
            inputs = runtime.processor.inputs(request, opts)
        else:
            inputs = await run_in_threadpool(runtime.processor.inputs, request, opts)
    except OptionError as exc:
        raise RequestError(400, str(exc), exc.option) from None
    except (ValueError, TypeError, KeyError) as exc:  # a KeyError's text is its quoted argument
        # The thread pool's future and the frames of this traceback refer to each other, so the refused
        # input (a prompt of megabytes) would live until the cyclic collector ran: free the frames' locals.
        traceback.clear_frames(exc.__traceback__)
        raise RequestError(400, str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)) from None
    stream = RequestStream(state, rid or uuid.uuid4().hex, inputs, opts)
    try:
        runtime.submit(stream.rid, inputs, opts, stream.sink)
    except AdmissionError as exc:  # a full queue drains as requests finish: ask the client to come back
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else None
        raise RequestError(exc.status, str(exc), headers=headers) from None
    state.metrics.started()
    return stream


async def merge(streams: list[RequestStream], ends: bool = False) -> AsyncIterator[tuple[int, Item | None]]:
    """Items of several streams as they arrive, tagged with the stream's index; with `ends`, also
    `(index, None)` right after a stream's last item (its `finish_reason` is final then)."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, end))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is end:
                remaining -= 1
                if ends:
                    yield index, None
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()
