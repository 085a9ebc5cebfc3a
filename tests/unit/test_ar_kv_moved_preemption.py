"""A sequence moved to another engine whose K/V depend on more than its token ids (media rows, explicit
positions) is never recomputed from its ids there: the receiver preempts another sequence instead, and
when none can give pages up it fails that request alone; a moved text sequence still preempts and
recomputes as before."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mstar.engines.autoregressive.sequence import SeqStatus
from mstar.engines.base import LoopSpec, StepItem
from mstar.engines.kv_handoff import KVPositions, KVStreamEnd
from mstar.models.common.loading import fill_dummy_weights
from mstar.models.llama.model import build_model
from mstar.models.llama.tiny import tiny_config
from tests.unit.test_ar_engine import make_engine, prompts
from tests.unit.test_ar_kv_handoff import _decode_item, _one_engine, _prefill_item, _run, _stream


def _drive(engine, watch=None) -> tuple[dict[str, list[int]], dict[str, str], list]:
    """Step until no item is pending, releasing each request at its last result (as the conductor does):
    each request's tokens, its error if it failed, and `watch`'s status after each step."""
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    statuses = []
    while engine.has_work():
        for r in engine.step():
            if r.error is not None:
                errors[r.request_id] = r.error
            else:
                tokens.setdefault(r.request_id, []).append(int(r.outputs["token"]))
            if r.error is not None or not r.more:
                engine.release(r.request_id)
        statuses.append(None if watch is None else watch.status)
    return tokens, errors, statuses


def _media_like(done: KVStreamEnd) -> KVStreamEnd:
    """`done` as a prompt with media rows would end: positions continue as for text (so the tokens stay
    comparable), but no token's K/V depend on its id alone, so the receiver cannot recompute it."""
    return replace(done, page_hashes=[], positions=KVPositions(len(done.tokens), 0.0, False, False, num_shareable=0))


@pytest.fixture(scope="module")
def qwen3():
    """A tiny Qwen3: unlike TinyLM it takes the extras (positions) a media-like moved sequence brings."""
    m = build_model(tiny_config("qwen3"), dtype=torch.float32)
    fill_dummy_weights(m, seed=1, std=0.3)
    return m


def _moved_beside_a_growing_sequence(model, media: bool):
    """b (16 pages) runs a plain 22-token engine loop of 20 steps, then a 30-token sequence moves in from a
    and decodes 8 steps: 14 pages at first, 21 needed in the end, so one of the two must give pages up."""
    opts = {"temperature": 0.0, "ignore_eos": True}
    prompt, other = prompts(8)[-1], prompts(8)[-2]
    old_item = replace(_prefill_item("old", other, **opts), loop=LoopSpec(20))
    alone = make_engine(model)
    alone.submit(old_item)
    want_old = _run(alone)
    a, b = make_engine(model), make_engine(model, pages=16)
    b.submit(old_item)
    (first_old,) = b.step()
    wire, skip, first = _stream(a, b, "r", prompt, **opts)
    assert skip == 0 and wire.done is not None
    b.submit_with_kv(_decode_item("r", prompt, first, 8, **opts), _media_like(wire.done) if media else wire.done)
    moved = b.batch_scheduler.running[-1]  # the newest running sequence: the usual first victim
    assert moved.key == ("r", "main")
    tokens, errors, statuses = _drive(b, moved)
    assert not errors, errors
    assert [int(first_old.outputs["token"]), *tokens["old"]] == want_old
    assert [first, *tokens["r"]] == _one_engine(model, prompt, 8, **opts)
    assert b.stats()["preemptions"] > 0 and b.stats()["kv_pages_used"] == 0 and not b.has_work()
    return statuses


@pytest.mark.usefixtures("one_thread")
def test_a_moved_sequence_that_cannot_recompute_is_not_preempted_while_another_can_be(qwen3):
    statuses = _moved_beside_a_growing_sequence(qwen3, media=True)
    # the moved one kept its pages until its request ended; the plain one was preempted and recomputed
    assert all(s in (SeqStatus.RUNNING, SeqStatus.PARKED) for s in statuses)
    assert SeqStatus.WAITING not in statuses


@pytest.mark.usefixtures("one_thread")
def test_a_moved_text_sequence_is_still_preempted_and_recomputed(qwen3):
    statuses = _moved_beside_a_growing_sequence(qwen3, media=False)
    assert SeqStatus.WAITING in statuses  # preempted while its loop had steps left, then recomputed


@pytest.mark.usefixtures("one_thread")
def test_a_moved_sequence_that_cannot_recompute_fails_alone_when_no_other_victim_exists(qwen3):
    model = qwen3
    opts = {"temperature": 0.0, "ignore_eos": True}
    p1, p2 = prompts(8)[-1], prompts(8)[-2]  # 8 and 6 pages; 12 decode steps make them 11 and 9 of 16
    a, b = make_engine(model), make_engine(model, pages=16)
    for rid, prompt in (("r1", p1), ("r2", p2)):
        wire, skip, first = _stream(a, b, rid, prompt, **opts)
        assert skip == 0 and wire.done is not None
        b.submit_with_kv(_decode_item(rid, prompt, first, 12, **opts), _media_like(wire.done))
        if rid == "r1":
            first_r1 = first
    tokens, errors, _ = _drive(b)
    assert set(errors) == {"r2"}  # the newest one gave its pages up; nothing recomputed it
    assert "cannot be recomputed there; raise the decode worker's KV pool" in errors["r2"]
    assert "kv_cache.max_num_pages" in errors["r2"] and "preemption" in errors["r2"]
    assert [first_r1, *tokens["r1"]] == _one_engine(model, p1, 12, **opts)
    assert b.stats()["kv_pages_used"] == 0 and b.stats()["prompt_tokens"] == 0 and not b.has_work()
    assert not b.batch_scheduler.running and not b.batch_scheduler.waiting and not b.batch_scheduler.dropped


@pytest.mark.usefixtures("one_thread")
def test_an_idle_moved_sequence_that_cannot_recompute_fails_its_next_item_once_dropped(qwen3):
    opts = {"temperature": 0.0, "ignore_eos": True}
    prompt = prompts(8)[-1]
    a, b = make_engine(qwen3), make_engine(qwen3, pages=12)
    wire, _, first = _stream(a, b, "r", prompt, **opts)
    b.submit_with_kv(_decode_item("r", prompt, first, 1, **opts), _media_like(wire.done))
    (result,) = b.step()  # its item answered, it idles on 8 pages for its caller's next one
    assert result.error is None and not b.has_work()
    b.submit(_prefill_item("x", prompts(8)[-2], **opts))  # 6 pages: r's are needed
    tokens, errors, _ = _drive(b)
    assert not errors and len(tokens["x"]) == 1 and b.stats()["preemptions"] == 0
    b.submit(StepItem("r", "decode", "llm", {"input_ids": torch.tensor([int(result.outputs["token"])])}, opts))
    (result,) = b.step()
    assert "cannot be recomputed there; raise the decode worker's KV pool" in result.error
    b.release("r")
    assert b.stats()["kv_pages_used"] == 0 and not b.has_work()

