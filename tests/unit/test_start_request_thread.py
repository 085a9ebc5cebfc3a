"""`start_request` builds a request's inputs in a worker thread, or on the event loop's own thread with
`inputs_on_loop` (the openpi route's chunks); either way the same inputs are submitted, and a refused
input is a 400 that submits nothing."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from mstar.models.base import Model, Processor
from mstar.server.adapters import RequestError, start_request


class _Processor(Processor):
    def __init__(self) -> None:
        self.threads: list[int] = []

    def inputs(self, request, options):
        self.threads.append(threading.get_ident())
        if request.get("text") == "refuse":
            raise ValueError("refused text")
        return {"prompt_ids": torch.tensor([1, 2, 3])}


class _Runtime:
    def __init__(self) -> None:
        self.processor, self.model, self.submitted = _Processor(), Model.__new__(Model), []

    def submit(self, rid, inputs, options, sink) -> None:
        self.submitted.append((rid, inputs))


def _state() -> SimpleNamespace:
    metrics = SimpleNamespace(started=lambda: None)
    return SimpleNamespace(runtime=_Runtime(), metrics=metrics, model_name="m")


def _start(state, request: dict, **kwargs) -> tuple[int, object]:
    async def run():
        stream = await start_request(state, request, {}, rid="r", **kwargs)
        return threading.get_ident(), stream

    return asyncio.run(run())


@pytest.mark.parametrize("on_loop", [False, True])
def test_inputs_are_built_where_asked(on_loop: bool) -> None:
    state = _state()
    loop_thread, stream = _start(state, {"text": "go"}, inputs_on_loop=on_loop)
    (built,) = state.runtime.processor.threads
    assert (built == loop_thread) is on_loop
    (rid, inputs), = state.runtime.submitted
    assert rid == stream.rid == "r" and inputs["prompt_ids"].tolist() == [1, 2, 3]
    assert stream.prompt_tokens == 3


@pytest.mark.parametrize("on_loop", [False, True])
def test_refused_inputs_are_a_400_and_submit_nothing(on_loop: bool) -> None:
    state = _state()
    with pytest.raises(RequestError, match="refused text") as caught:
        _start(state, {"text": "refuse"}, inputs_on_loop=on_loop)
    assert caught.value.status == 400 and state.runtime.submitted == []
