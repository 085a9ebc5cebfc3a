"""A sequence moved between two autoregressive engines (`KVHandoff`: hold_prefix, export_kv, submit_with_kv)
continues as on one engine, computes no prompt token on the receiver, sends only the pages the receiver's
prefix cache lacks, and falls back to recomputing when it cannot move; nothing leaks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mstar.engines.base import LoopSpec, StepItem
from mstar.engines.kv_handoff import KVHandoff
from tests.unit.test_ar_engine import TinyLM, make_engine, prompts


@pytest.fixture(scope="module")
def model():
    return TinyLM()


def _run(engine) -> list[int]:
    """Drive one engine-loop item to its end; its sampled tokens."""
    out = []
    while engine.has_work():
        for r in engine.step():
            assert r.error is None, r.error
            out.append(int(r.outputs["token"]))
    return out


def _prefill(engine, rid: str, prompt: list[int], **options) -> int:
    engine.submit(StepItem(rid, "prefill", "llm", {"input_ids": torch.tensor(prompt)}, options))
    (result,) = engine.step()
    return int(result.outputs["token"])


def _decode_item(rid: str, prompt: list[int], first: int, steps: int, **options) -> StepItem:
    return StepItem(rid, "decode", "llm", {"input_ids": torch.tensor([first]), "prompt_ids": torch.tensor(prompt)},
                    options, loop=LoopSpec(steps))


def _one_engine(model, prompt, steps, **options) -> list[int]:
    engine = make_engine(model)
    first = _prefill(engine, "r", prompt, **options)
    engine.submit(replace(_decode_item("r", prompt, first, steps, **options), inputs={"input_ids": torch.tensor([first])}))
    return [first, *_run(engine)]


@pytest.mark.parametrize("options", [{"temperature": 0.0, "ignore_eos": True},
                                     {"temperature": 1.0, "seed": 7, "ignore_eos": True, "frequency_penalty": 0.5}])
def test_moved_sequence_continues_as_on_one_engine(model, options):
    prompt = prompts(8)[-1]  # 30 tokens: 7 full pages of 4 and a partial one
    want = _one_engine(model, prompt, 6, **options)
    a, b = make_engine(model), make_engine(model)
    assert isinstance(a, KVHandoff)
    first = _prefill(a, "r", prompt, **options)
    it = _decode_item("r", prompt, first, 6, **options)
    held = b.hold_prefix(it)
    assert held == []  # b has seen nothing
    export = a.export_kv("r", "main", held)
    assert export is not None and export.skip == 0 and export.k is not None and export.k.shape[1] == 8
    assert a.stats()["kv_pages_used"] == 0 and a.export_kv("r", "main", []) is None  # forgotten on a
    b.submit_with_kv(it, export)
    assert [first, *_run(b)] == want
    stats = b.stats()
    assert stats["prompt_tokens"] == 0 and stats["kv_pages_received"] == 8 and stats["kv_pages_reused"] == 0
    b.release("r")
    assert b.stats()["kv_pages_used"] == 0


def test_pages_the_receiver_caches_do_not_travel(model):
    prompt = prompts(8)[-1]
    want = _one_engine(model, prompt, 4, temperature=0.0, ignore_eos=True)
    a, b = make_engine(model), make_engine(model)
    for rid in ("r1", "r2"):  # the second time b's prefix cache holds the prompt's 7 full pages
        first = _prefill(a, rid, prompt, temperature=0.0, ignore_eos=True)
        it = _decode_item(rid, prompt, first, 4, temperature=0.0, ignore_eos=True)
        held = b.hold_prefix(it)
        export = a.export_kv(rid, "main", held)
        b.submit_with_kv(it, export)
        assert [first, *_run(b)] == want
        b.release(rid)
    assert len(held) == 7 and export.skip == 7 and export.k.shape[1] == 1
    stats = b.stats()
    assert stats["kv_pages_reused"] == 7 and stats["kv_pages_received"] == 8 + 1 and stats["prompt_tokens"] == 0
    assert a.stats()["kv_pages_sent"] == 9 and stats["kv_pages_used"] == 0


def test_a_sequence_that_cannot_move_is_recomputed(model):
    prompt = prompts(8)[-1]
    want = _one_engine(model, prompt, 4, temperature=0.0, ignore_eos=True)
    a = make_engine(model)
    first = _prefill(a, "r", prompt, temperature=0.0, ignore_eos=True)
    b = make_engine(model)
    it = _decode_item("r", prompt, first, 4, temperature=0.0, ignore_eos=True)
    b.hold_prefix(it)
    assert a.export_kv("gone", "main", []) is None
    b.submit_with_kv(it, None)  # the sender had nothing: the prompt is recomputed from prompt_ids
    assert [first, *_run(b)] == want
    assert b.stats()["prompt_tokens"] == len(prompt) and b.stats()["kv_pages_received"] == 0


def test_release_while_waiting_frees_the_held_pages(model):
    prompt = prompts(8)[-1]
    b = make_engine(model)
    first = _prefill(b, "warm", prompt, temperature=0.0)
    b.release("warm")  # its 7 full pages stay cached
    cached = b.stats()["kv_pages_cached"]
    it = _decode_item("r", prompt, first, 4)
    assert len(b.hold_prefix(it)) == 7 and b.stats()["kv_pages_used"] == 7
    b.release("r")
    assert b.stats()["kv_pages_used"] == 0 and b.stats()["kv_pages_cached"] == cached


def test_warm_up_prompts_are_not_counted(model):
    engine = make_engine(model, warm_up=True)  # as on CUDA: throwaway prompts run before serving
    assert engine.stats()["prompt_tokens"] == 0
