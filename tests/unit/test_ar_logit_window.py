"""Logits over a window of ids (`CausalLM.logit_offset`, e.g. Orpheus' speakable span): the engine samples
over the window's columns and hands back token ids. Against the same model returning full-vocabulary
logits that are -inf outside the window (what the span head returned before), on every CPU-drivable
path: eager sampling, lookahead (ids fed back on the device), and the decode and sampler graphs run
eagerly (tests/unit/graph_standins.py) with lookahead."""

import math

import pytest
import torch

from mstar.engines.autoregressive import CONTEXT_PORT, AutoregressiveEngine
from mstar.engines.kv_cache.config import KVCacheConfig
from mstar.engines.sampling import SamplingParams
from tests.unit.test_ar_engine import VOCAB, TinyLM, item, make_engine, prompts, tokens_of
from tests.unit.test_ar_packed_decode import drive_staggered, graphed

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

LO, HI, BLOCKED = 20, 52, (21, 25)  # the window [LO, HI) of the 61 ids, with ids never spoken inside it
SPEAKABLE = set(range(LO, HI)) - set(range(*BLOCKED))


def _window_logits(model, hidden):
    logits = TinyLM.compute_logits(model, hidden)[:, LO:HI].clone()
    logits[:, BLOCKED[0] - LO:BLOCKED[1] - LO] = -math.inf
    return logits


class WindowLM(TinyLM):
    """TinyLM whose logits are the window's columns only (blocked ids -inf)."""

    logit_offset = LO
    logit_width = HI - LO

    def compute_logits(self, hidden, input_ids=None, out=None):
        return _window_logits(self, hidden)


class MaskedLM(TinyLM):
    """The same logits over the whole vocabulary, -inf outside the window and on the blocked ids."""

    def compute_logits(self, hidden, input_ids=None, out=None):
        logits = torch.full((hidden.shape[0], VOCAB), -math.inf)
        logits[:, LO:HI] = _window_logits(self, hidden)
        return logits


@pytest.fixture(scope="module")
def models():
    return WindowLM(), MaskedLM()


GREEDY = {"temperature": 0.0, "max_tokens": 14}  # plain greedy: the decode graph's argmax when graphed
PENALISED = {**GREEDY, "repetition_penalty": 1.3}  # the sampler graphs' seen-token rows when graphed
BANNED = {**PENALISED, "min_tokens": 10}  # eos banned: eager `sample`
SAMPLED = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3, "max_tokens": 30}  # Orpheus' defaults


def _items(options_list):
    ps = prompts(8)[1:7]  # ids all over the vocabulary: seen ids outside the window are left out
    return [item(f"{name}{i}", p, **options) for name, options in options_list for i, p in enumerate(ps)]


def _run(engine, items):
    out = drive_staggered(engine, items, [i % 5 for i in range(len(items))])
    return {rid: tokens_of(results) for rid, results in out.items()}


def _eos(masked):
    """An eos inside the window that greedy says early (so that min_tokens bans it), and one outside."""
    first = _run(make_engine(masked), _items([("p", PENALISED)]))["p0"][0]
    return (first, 3)


@pytest.mark.parametrize("mode", ["eager", "lookahead", "graphed"])
def test_greedy_tokens_equal_those_of_full_minus_inf_logits(models, monkeypatch, mode):
    """Greedy (the decode graph's argmax when graphed), greedy under repetition penalty 1.3 (the sampler
    graphs when graphed) and under min_tokens banning an eos greedy says at once, one run each."""
    window, masked = models
    eos = _eos(masked)
    for name, options in (("g", GREEDY), ("p", PENALISED), ("b", BANNED)):
        items = _items([(name, options)])
        want = _run(make_engine(masked, eos_token_ids=eos), items)
        if mode == "graphed":
            engine = graphed(window, monkeypatch)
            engine.eos_token_ids = eos
        else:
            engine = make_engine(window, eos_token_ids=eos, lookahead=mode == "lookahead")
        got = _run(engine, items)
        assert got == want
        assert set().union(*got.values()) <= SPEAKABLE and engine.logit_offset == LO
        if mode != "eager":
            assert engine.lookahead_steps > 5  # forwards fed the sampled ids straight from the device
        if mode == "graphed":
            assert engine.runner.graphs.calls > 5
            if name == "p":  # (greedy decode steps take the decode graph's argmax)
                assert engine.sampler.replays > 5
        if name == "p":
            assert want["p0"] == [eos[0]]
        if name == "b":
            assert eos[0] not in want["b0"][:10]  # the ban changed what greedy says


@pytest.mark.parametrize("mode", ["eager", "graphed"])
def test_sampled_tokens_stay_in_the_window_and_repeat_run_to_run(models, monkeypatch, mode):
    """Orpheus' default options: seeded (eager, with logprobs) and unseeded under one global seed (through
    the sampler graphs): tokens and top ids inside the window, the same in two runs."""
    window, _ = models
    options = {**SAMPLED, "seed": 11, "logprobs": 3} if mode == "eager" else SAMPLED
    runs, top_ids = [], set()
    for _ in range(2):
        torch.manual_seed(0)
        engine = graphed(window, monkeypatch) if mode == "graphed" else make_engine(window)
        items = _items([("s", options)])
        out = drive_staggered(engine, items, [0] * len(items))
        runs.append({rid: tokens_of(results) for rid, results in out.items()})
        top_ids |= {int(t) for results in out.values() for r in results for t in r.outputs.get("top_ids", [])}
    assert runs[0] == runs[1]
    made = set().union(*runs[0].values())
    assert made <= SPEAKABLE and len(made) > 5
    if mode == "eager":
        assert top_ids and top_ids <= set(range(LO, HI))
    else:
        assert engine.sampler.replays > 5


def test_resumed_seeded_sequence_skips_draws_of_the_window_width(models):
    """A seeded sequence resumed from prompt_ids on another engine skips one draw of `logit_width` per
    token already generated, so it continues with the tokens it would have sampled."""
    window, _ = models
    options = {**SAMPLED, "seed": 5, "max_tokens": 16}
    prompt = prompts(8)[4]

    def engine():
        return AutoregressiveEngine(window, KVCacheConfig(max_num_pages=64, page_size=4), "cpu",
                              default_sampling=SamplingParams(temperature=0.0))

    whole = _run(engine(), [item("a", prompt, **options)])["a"]
    head = whole[:5]
    resumed = item("a", head, **options)
    resumed.inputs[CONTEXT_PORT] = torch.tensor(prompt)
    rest = _run(engine(), [resumed])["a"]
    assert whole[5:] == rest and set(whole) <= SPEAKABLE


class WindowIntoLM(WindowLM):
    """WindowLM writing its logits into the buffer the engine passes (`CausalLM`: `out`), as the window
    head kernel does for the decode graphs' `logits_out`."""

    def __init__(self):
        super().__init__()
        self.written_into = 0

    def compute_logits(self, hidden, input_ids=None, out=None):
        logits = _window_logits(self, hidden)
        if out is None:
            return logits
        self.written_into += 1
        return out.copy_(logits)


def test_a_head_writing_into_the_sampler_graphs_logits_gives_the_same_tokens(models, monkeypatch):
    """The decode graphs hand the head the rows of `logits_out` (the sampler graphs' input) and take what it
    wrote there without a copy: penalised greedy as the full -inf logits give it, and Orpheus' sampled
    defaults (one global seed) as the head that returns its own tensor gives them."""
    window, masked = models
    items = _items([("p", PENALISED)])
    into = WindowIntoLM()
    engine = graphed(into, monkeypatch)
    assert _run(engine, items) == _run(make_engine(masked), items)
    assert into.written_into > 5 and engine.runner.graphs.calls > 5
    items = _items([("s", SAMPLED)])
    runs = []
    for model in (window, WindowIntoLM()):
        torch.manual_seed(0)
        runs.append(_run(graphed(model, monkeypatch), items))
    assert runs[0] == runs[1] and len(set().union(*runs[0].values())) > 5
