"""BAGEL's understanding decode on CUDA (tiny, float32): contexts in the paged pool, decode rows through the
Triton paged decode kernel, decode batches replayed from the CUDA graphs of the LLM's decode plan; the answers
equal those of the same requests with graphs off, and every page is back in the pool once they finish."""

from __future__ import annotations

import time

import numpy as np

PHOTO = (np.random.default_rng(0).random((40, 56, 3)) * 255).astype(np.uint8)
REQUESTS = [{"text": "What is in this picture?", "media": [{"type": "image", "data": PHOTO}]}, {"text": "Hi"},
            {"text": "Describe the colors and the objects you see, one by one, in detail."},
            {"text": "And the sky?", "media": [{"type": "image", "data": PHOTO[:, :28]}]}]


def _answers(graphs: bool) -> tuple[list[list[str]], list, bool]:
    from mstar.runtime.offline import MStar

    config = {"model": "bagel", "device": "cuda", "max_concurrent_requests": 4, "cuda_graphs": {"enabled": graphs}}
    with MStar("bagel", config=config, tiny=True) as m:
        llm = m.runtime.workers[0].engines["llm"].module
        handles = [m.submit(r, max_tokens=16, temperature=0.0) for r in REQUESTS]
        texts = [h.decoded().outputs.get("text", []) for h in handles]
        deadline = time.monotonic() + 5
        while llm.num_contexts and time.monotonic() < deadline:
            time.sleep(0.01)
        return texts, llm.graphs.keys(), llm.pool.num_free == llm.pool.spec.num_pages


def test_decode_graphs_answer_as_eager_decode_and_give_pages_back() -> None:
    (graphed, keys, freed), (eager, no_keys, freed_eager) = _answers(True), _answers(False)
    assert keys == ["decode"] and no_keys == []
    assert graphed == eager and any(graphed)
    assert freed and freed_eager
