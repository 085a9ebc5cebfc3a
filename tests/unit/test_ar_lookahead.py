"""Decode lookahead (engines/autoregressive/lookahead.py): launching step N+1 before N's tokens are read
changes when work runs, never what comes out. On CPU the lookahead forward runs eagerly."""

import pytest

from tests.unit.test_ar_engine import TinyLM, drive, item, make_engine, prompts, reference, tokens_of


@pytest.fixture(scope="module")
def model():
    return TinyLM()


def test_single_request_uses_lookahead_and_matches_reference(model):
    prompt = prompts(8)[5]
    engine = make_engine(model, lookahead=True)
    out = drive(engine, [item("a", prompt, max_tokens=12)])[("a", "main")]
    assert tokens_of(out) == reference(model, prompt, 12)
    # every token after the first comes from a forward launched ahead, also those that open a new page
    # (page size 4: the lookahead takes the page from the pool first)
    assert engine.lookahead_hits == 11 and engine.lookahead_misses == 0
    assert out[-1].finish_reason == "length" and engine.pool.num_used == 0


@pytest.mark.parametrize("max_batch_tokens", [2048, 8])
def test_batched_requests_with_lookahead_match_reference(model, max_batch_tokens):
    ps = prompts(8)
    engine = make_engine(model, max_batch_tokens=max_batch_tokens, lookahead=True)
    out = drive(engine, [item(f"r{i}", p, max_tokens=6 + i) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert tokens_of(out[(f"r{i}", "main")]) == reference(model, p, 6 + i)
    assert engine.lookahead_hits > 0


def test_preemption_and_eos_with_lookahead(model):
    ps = prompts(8)[2:8]
    ref = [reference(model, p, 10) for p in ps]
    eos = ref[0][3]
    plain = drive(make_engine(model, pages=12, max_model_len=48, eos_token_ids=(eos,)),
                  [item(f"r{i}", p, max_tokens=10) for i, p in enumerate(ps)])
    engine = make_engine(model, pages=12, max_model_len=48, eos_token_ids=(eos,), lookahead=True)
    out = drive(engine, [item(f"r{i}", p, max_tokens=10) for i, p in enumerate(ps)])
    assert engine.scheduler.num_preemptions > 0
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
    real = engine.scheduler.grow_ahead
    engine.scheduler.grow_ahead = lambda seqs: grown.append(real(seqs)) or grown[-1]
    out = drive(engine, [item(f"r{i}", p, max_tokens=12) for i, p in enumerate(ps)])
    assert {k: tokens_of(v) for k, v in out.items()} == {k: tokens_of(v) for k, v in plain.items()}
    assert True in grown and False in grown  # pages taken ahead, and refused once the pool ran dry
    assert engine.scheduler.num_preemptions == plain_engine.scheduler.num_preemptions > 0
    assert engine.pool.num_used == 0


def test_fed_back_token_differs_from_sample(model):
    """A walk may feed something other than the sampled token: the guess is dropped, outputs are those
    of an engine without lookahead driven the same way."""
    prompt = prompts(8)[6]

    def shift(token):
        return (token + 1) % 61

    plain = drive(make_engine(model), [item("a", prompt, max_tokens=9)], feed=shift)[("a", "main")]
    engine = make_engine(model, lookahead=True)
    out = drive(engine, [item("a", prompt, max_tokens=9)], feed=shift)[("a", "main")]
    assert tokens_of(out) == tokens_of(plain)
    assert engine.lookahead_hits == 0 and engine.lookahead_misses > 0


def test_seeded_sampling_same_with_and_without_lookahead(model):
    ps = prompts(8)[3:6]
    options = {"temperature": 0.9, "top_p": 0.9, "repetition_penalty": 1.3, "seed": 7, "max_tokens": 10}
    runs = []
    for lookahead in (False, True):
        engine = make_engine(model, lookahead=lookahead)
        out = drive(engine, [item(f"r{i}", p, **options) for i, p in enumerate(ps)])
        runs.append({k: tokens_of(v) for k, v in out.items()})
    assert runs[0] == runs[1]


def test_release_drops_the_lookahead(model):
    engine = make_engine(model, lookahead=True)
    engine.submit(item("a", prompts(8)[4], max_tokens=20))
    results = []
    while not results or engine._ahead is None:
        results = engine.step()
        for r in results:
            engine.submit(item("a", r.outputs["token"]))
    engine.release("a")
    assert engine._ahead is None and not engine.has_work() and engine.pool.num_used == 0
    assert engine.step() == []


def test_off_by_default_without_cuda_graphs(model):
    assert make_engine(model).lookahead is False  # on CPU: no decode graphs
