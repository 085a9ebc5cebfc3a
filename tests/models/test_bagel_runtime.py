"""BAGEL's requests interleave on one worker: a request that arrives later joins a running one's LLM forwards at
its own step; a cancelled generation stops at the next step and leaves no context behind."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from mstar.runtime.offline import MStar, RequestFailed

pytestmark = pytest.mark.usefixtures("one_thread")
PHOTO = (np.random.default_rng(1).random((48, 64, 3)) * 255).astype(np.uint8)


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


@pytest.mark.parametrize(("request_", "options", "views", "batch"), [
    ({"text": "Make the sky purple", "media": [{"type": "image", "data": PHOTO}]}, {}, {"no_text"}, None),
    ({"text": "Make the sky purple", "media": [{"type": "image", "data": PHOTO}]}, {}, {"no_text"}, 1),
    ({"text": "A red fox"}, {"modalities": ["text", "image"], "max_tokens": 2}, {"no_text", "no_image"}, None),
])
def test_guidance_contexts_share_the_full_contexts_prefix(request_, options, views, batch):
    """The no-text context (the full one less its last text) and, without images, the no-image one (less the
    thought) are views of the full context's keys and values: they hold the first pages of the full context
    (a thought the full context grew by since lands past them), not copies, also when the guidance branch is
    prefilled in a later batch than the full one (one item a batch), as the pool's admission counts them; a
    cancelled request's pages go back to the pool."""
    config = {"model": "bagel", "engines": {"llm": {"max_batch_size": batch}}} if batch else None
    with MStar("bagel", config, tiny=True) as m:
        handle = m.submit(request_, **{"modalities": ["image"], "num_inference_steps": 200, "seed": 1,
                                       "debug_outputs": True, **options})
        _first_step(handle)
        llm = m.runtime.workers[0].engines["llm"].module
        contexts = {branch: c for (_, branch), c in llm.contexts().items()}  # the one request's
        full = contexts["full"]
        assert {b for b, c in contexts.items() if c.view} == views and set(contexts) == {"full", "no_text", "no_image"}
        for branch in views:
            view = contexts[branch]
            assert 0 < view.length < full.length and view.pages == full.pages[:len(view.pages)]
            for layer in range(full.pool.k_cache.shape[0]):
                torch.testing.assert_close(view.layer(layer)[0], full.layer(layer)[0][:view.length], atol=0, rtol=0)
        pool, held = full.pool, {p for c in contexts.values() for p in c.pages}
        handle.cancel()
        deadline = time.monotonic() + 5
        while llm.num_contexts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert llm.num_contexts == 0 and all(pool.blocks.refcount(p) == 0 for p in held)


def _answers(m: MStar, prompts: list[str]) -> list[str]:
    handles = [m.submit({"text": p}, max_tokens=40, ignore_eos=True, request_id=f"r{i}") for i, p in enumerate(prompts)]
    return ["".join(h.decoded().outputs["text"]) for h in handles]


def test_requests_beyond_the_kv_pool_wait_for_pages_and_one_that_never_fits_is_refused():
    """With a pool of 8 pages (128 tokens), four answers of about 4 pages each at once: each waits for the pages
    of those before it and all finish as they do in a large pool, every page given back; a request whose
    context and answer exceed the whole pool is refused at submission (a 400 at the HTTP layer), alone."""
    prompts = [f"a story number {i} about a fox" for i in range(4)]
    with MStar("bagel", tiny=True) as m:
        expected = _answers(m, prompts)
    with MStar("bagel", {"model": "bagel", "model_kwargs": {"kv_tokens": 128}}, tiny=True) as m:
        with pytest.raises(ValueError, match="model_kwargs.kv_tokens"):
            m.submit({"text": "a fox"}, max_tokens=200)
        assert _answers(m, prompts) == expected
        llm, deadline = m.runtime.workers[0].engines["llm"].module, time.monotonic() + 5
        while llm.num_contexts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert llm.num_contexts == 0 and llm.pool.num_free == 8
