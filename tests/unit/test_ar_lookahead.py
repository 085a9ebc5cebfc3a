"""Decode lookahead (engines/autoregressive/lookahead.py): launching an engine loop's step N+1 before N's
tokens are read changes when work runs, never what comes out. On CPU the lookahead forward runs eagerly."""

from dataclasses import replace

import pytest

from mstar.engines.base import LoopSpec
from tests.unit.test_ar_engine import TinyLM, drive, item, make_engine, prompts, reference, tokens_of


@pytest.fixture(scope="module")
def model():
    return TinyLM()


def test_single_request_uses_lookahead_and_matches_reference(model):
    prompt = prompts(8)[5]
    engine = make_engine(model, lookahead=True)
    out = drive(engine, [item("a", prompt, max_tokens=12)], loop=True)[("a", "main")]
    assert tokens_of(out) == reference(model, prompt, 12)
    # every token after the first comes from a forward launched ahead, also those that open a new page
    # (page size 4: the lookahead takes the page from the pool first)
    assert engine.lookahead_steps == 11
    assert out[-1].finish_reason == "length" and engine.pool.num_used == 0


@pytest.mark.parametrize("max_batch_tokens", [2048, 8])
def test_batched_requests_with_lookahead_match_reference(model, max_batch_tokens):
    ps = prompts(8)
    engine = make_engine(model, max_batch_tokens=max_batch_tokens, lookahead=True)
    out = drive(engine, [item(f"r{i}", p, max_tokens=6 + i) for i, p in enumerate(ps)], loop=True)
    for i, p in enumerate(ps):
        assert tokens_of(out[(f"r{i}", "main")]) == reference(model, p, 6 + i)
    assert engine.lookahead_steps > 0


def test_preemption_and_eos_with_lookahead(model):
    ps = prompts(8)[2:8]
    ref = [reference(model, p, 10) for p in ps]
    eos = ref[0][3]
    plain = drive(make_engine(model, pages=12, max_model_len=48, eos_token_ids=(eos,)),
                  [item(f"r{i}", p, max_tokens=10) for i, p in enumerate(ps)])
    engine = make_engine(model, pages=12, max_model_len=48, eos_token_ids=(eos,), lookahead=True)
    out = drive(engine, [item(f"r{i}", p, max_tokens=10) for i, p in enumerate(ps)], loop=True)
    assert engine.batch_scheduler.num_preemptions > 0 and engine.lookahead_steps > 0
    for key in plain:
        assert tokens_of(out[key]) == tokens_of(plain[key])
        assert out[key][-1].finish_reason == plain[key][-1].finish_reason
    assert any(r[-1].finish_reason == "stop" for r in out.values())
    assert engine.pool.num_used == 0


def test_no_free_page_skips_the_lookahead_without_preempting(model):
    """A lookahead that needs a new page takes only a free one: with the pool full, the step runs as
    usual (the scheduler preempts if it must), with the same tokens as without lookahead."""
    ps = prompts(8)[2:6]
    plain_engine = make_engine(model, pages=12, max_model_len=32)
    plain = drive(plain_engine, [item(f"r{i}", p, max_tokens=12) for i, p in enumerate(ps)])
    engine = make_engine(model, pages=12, max_model_len=32, lookahead=True)
    grown = []
    real = engine.batch_scheduler.grow_ahead
    engine.batch_scheduler.grow_ahead = lambda seqs: grown.append(real(seqs)) or grown[-1]
    out = drive(engine, [item(f"r{i}", p, max_tokens=12) for i, p in enumerate(ps)], loop=True)
    assert {k: tokens_of(v) for k, v in out.items()} == {k: tokens_of(v) for k, v in plain.items()}
    assert True in grown and False in grown  # pages taken ahead, and refused once the pool ran dry
    assert engine.batch_scheduler.num_preemptions == plain_engine.batch_scheduler.num_preemptions > 0
    assert engine.pool.num_used == 0


def test_only_engine_loops_run_ahead(model):
    """Items fed back by their caller (the walk interpreter's loops) bring a token the engine cannot know
    in advance: nothing runs ahead, and a caller may feed anything."""
    prompt = prompts(8)[6]

    def shift(token):
        return (token + 1) % 61

    plain = drive(make_engine(model), [item("a", prompt, max_tokens=9)], feed=shift)[("a", "main")]
    engine = make_engine(model, lookahead=True)
    out = drive(engine, [item("a", prompt, max_tokens=9)], feed=shift)[("a", "main")]
    assert tokens_of(out) == tokens_of(plain) and engine.lookahead_steps == 0


def test_new_work_waits_one_step_at_most(model):
    """A request that arrives while an engine loop runs ahead is not run ahead of: the step launched
    ahead runs without it, the next one admits it."""
    ps = prompts(8)
    engine = make_engine(model, lookahead=True)
    engine.submit(replace(item("a", ps[4], max_tokens=20), loop=LoopSpec(100)))
    while engine._ahead is None:
        engine.step()
    engine.submit(replace(item("b", ps[6], max_tokens=5), loop=LoopSpec(100)))
    engine.step()  # a's step, launched before b came
    assert [s.key[0] for s in engine.batch_scheduler.running] == ["a"] and engine._ahead is None
    engine.step()
    assert [s.key[0] for s in engine.batch_scheduler.running] == ["a", "b"]
    out = {}
    while engine.has_work():
        for r in engine.step():
            out.setdefault(r.request_id, []).append(int(r.outputs["token"]))
    assert out["b"] == reference(model, ps[6], 5)[1:]


def test_prefill_among_engine_loops_is_not_run_ahead_of(model):
    """A prefill (an item that is not an engine loop) ending among engine loops launches nothing ahead:
    its caller's next item (the decode loop, as a worker submits it before the next step) joins the
    next step instead of waiting behind a forward launched without it."""
    ps = prompts(8)
    engine = make_engine(model, lookahead=True)
    engine.submit(replace(item("a", ps[4], max_tokens=30), loop=LoopSpec(100)))
    while engine._ahead is None:
        engine.step()
    engine.submit(item("b", ps[6], max_tokens=6))  # its prefill, arriving while a runs ahead
    engine.step()  # a's step, launched before b came
    (prefill,) = [r for r in engine.step() if r.request_id == "b"]
    assert engine._ahead is None  # b's next item could not have joined a forward launched now
    engine.submit(replace(item("b", [int(prefill.outputs["token"])], max_tokens=6), loop=LoopSpec(100)))
    steps, out = 0, [int(prefill.outputs["token"])]
    while not out[1:]:  # steps from the decode loop's submit to its first token
        steps += 1
        out += [int(r.outputs["token"]) for r in engine.step() if r.request_id == "b"]
    assert steps == 1
    while engine.has_work():
        out += [int(r.outputs["token"]) for r in engine.step() if r.request_id == "b"]
    assert out == reference(model, ps[6], 6) and engine.lookahead_steps > 0


def test_seeded_sampling_same_with_and_without_lookahead(model):
    ps = prompts(8)[3:6]
    options = {"temperature": 0.9, "top_p": 0.9, "repetition_penalty": 1.3, "seed": 7, "max_tokens": 10}
    runs = []
    for lookahead in (False, True):
        engine = make_engine(model, lookahead=lookahead)
        out = drive(engine, [item(f"r{i}", p, **options) for i, p in enumerate(ps)], loop=True)
        runs.append({k: tokens_of(v) for k, v in out.items()})
    assert runs[0] == runs[1]


def test_release_and_stops_leave_the_rest_of_the_step_ahead(model):
    """A sequence released (or stopped) after its row was launched ahead is left out of that step; the
    others take their rows and come out as without lookahead."""
    ps = prompts(8)
    engine = make_engine(model, lookahead=True)
    for rid, p in (("a", ps[4]), ("b", ps[5]), ("c", ps[6])):
        engine.submit(replace(item(rid, p, max_tokens=12), loop=LoopSpec(100)))
    out: dict[str, list[int]] = {}
    while engine._ahead is None or len(engine._ahead.seqs) < 3:
        for r in engine.step():
            out.setdefault(r.request_id, []).append(int(r.outputs["token"]))
    engine.release("b")
    while engine.has_work():
        for r in engine.step():
            out.setdefault(r.request_id, []).append(int(r.outputs["token"]))
    assert out["a"] == reference(model, ps[4], 12) and out["c"] == reference(model, ps[6], 12)
    assert engine.lookahead_steps > 10 and engine.pool.num_used == 0 and not engine._seqs


def test_off_by_default_without_cuda_graphs(model):
    assert make_engine(model).lookahead is False  # on CPU: no decode graphs
