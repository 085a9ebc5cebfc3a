"""BAGEL's requests interleave on one worker: a request that arrives later joins a running one's LLM forwards at
its own step; a cancelled generation stops at the next step and leaves no context behind."""

from __future__ import annotations

import time

import pytest

from mstar.runtime.offline import MStar, RequestFailed

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def spied(monkeypatch):
    """Every denoise forward of the LLM: the (request, loop iteration) of each of its items."""
    from mstar.models.bagel.components import LLMComponent

    calls: list[set[tuple[str, int]]] = []
    original = LLMComponent.run_items

    def spy(self, items):
        if items[0].walk == "denoise":
            calls.append({(i.request_id.split("#")[0], i.iteration) for i in items})  # the runtime suffixes ids
        return original(self, items)

    monkeypatch.setattr(LLMComponent, "run_items", spy)
    return calls


def _first_step(handle) -> None:
    for event in handle:
        if event.name == "step_latents":
            return


def test_a_later_request_joins_at_its_own_step(spied):
    with MStar("bagel", tiny=True) as m:
        first = m.submit({"text": "a fox"}, modalities=["image"], num_inference_steps=16, seed=1, debug_outputs=True,
                         request_id="first")
        _first_step(first)
        second = m.submit({"text": "a boat"}, modalities=["image"], num_inference_steps=3, seed=2, request_id="second")
        second.result(), first.result()
    shared = [c for c in spied if {r for r, _ in c} == {"first", "second"}]
    assert shared, spied
    assert any(dict(c)["first"] != dict(c)["second"] for c in shared)  # the same forward, different steps


def test_cancel_stops_at_the_next_step_and_frees_the_contexts():
    with MStar("bagel", tiny=True) as m:
        handle = m.submit({"text": "a fox"}, modalities=["image"], num_inference_steps=200, seed=1, debug_outputs=True)
        _first_step(handle)
        assert handle.cancel()
        steps = 1
        try:
            steps += sum(event.name == "step_latents" for event in handle)
        except RequestFailed:
            pass
        llm, deadline = m.runtime.workers[0].engines["llm"].module, time.monotonic() + 5
        while llm.num_contexts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert llm.num_contexts == 0
    assert steps < 10
