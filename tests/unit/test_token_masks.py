"""Structured outputs' token masks on the device (engines/token_masks.py, kernels/token_mask.py): the mask
equals the host reference `grammar.mask_logits`, unflagged rows are untouched, and the autoregressive
engine runs constrained sequences ahead (each sampled token reaches its matcher after the next forward
was launched) and draws them through the sampler and step graphs, with the scripted tokens exactly: beside
rows that sample eagerly and free rows, through preemption, over a windowed head's columns, and after a
step that a refused token failed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mstar.engines.autoregressive.step_graph import StepGraphs
from mstar.engines.base import LoopSpec
from mstar.engines.grammar import canonical_spec, mask_logits
from mstar.engines.token_masks import TokenMasks
from tests.interpreted import run_interpreted
from tests.unit.graph_standins import EagerBatchGraphs
from tests.unit.test_ar_engine import VOCAB, TinyLM, item, make_engine, prompts, reference, tokens_of
from tests.unit.test_ar_packed_decode import POOL, drive_staggered, graphed
from tests.unit.test_grammar_mask import Script

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

EOS = VOCAB - 1


@pytest.fixture(scope="module")
def model():
    return TinyLM()


class Bits:
    """A matcher that allows a fixed random set of tokens (written as a whole row, as xgrammar does)."""

    def __init__(self, row: torch.Tensor) -> None:
        self.row = row

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row, : self.row.numel()] = self.row


@pytest.mark.parametrize(("width", "offset"), [(100, 0), (70, 30), (64, 0)])
def test_staged_masks_equal_the_host_reference(width, offset):
    g = torch.Generator().manual_seed(width + offset)
    masks = TokenMasks(6, width, "cpu", offset)
    words = masks.words - 1 if offset else masks.words  # a matcher over fewer ids: the rest are forbidden
    matchers = [None if i % 3 == 1 else Bits(torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32,
                                                            generator=g)) for i in range(5)]
    logits = torch.randn(5, width, generator=g)
    bitmask = torch.zeros(5, masks.words, dtype=torch.int32)
    rows = [i for i, m in enumerate(matchers) if m is not None]
    for j, i in enumerate(rows):
        matchers[i].fill_bitmask(bitmask, j)
    want = mask_logits(logits, rows, bitmask[: len(rows)], offset)
    assert masks.stage(matchers)
    got = logits.clone()
    masks.apply_(got)
    assert torch.equal(got, want)
    # a batch without grammars clears the flags: nothing is masked, whatever the bitmask still holds
    assert not masks.stage([None] * 5)
    got = logits.clone()
    masks.apply_(got)
    assert torch.equal(got, logits) and int(masks.flags.abs().sum()) == 0


def test_token_mask_kernel_interpreted():
    pytest.importorskip("triton")
    proc = run_interpreted(Path(__file__).with_name("token_mask_check.py"))
    assert proc.returncode == 0 and "token mask ok" in proc.stdout, proc.stderr[-3000:]


class Logged(Script):
    """A scripted matcher that logs each token it accepts."""

    def __init__(self, tokens: list[int], eos: int, key: str, log: list) -> None:
        super().__init__(tokens, eos)
        self.key, self.log = key, log

    def accept(self, token_id: int) -> bool:
        self.log.append(("accept", self.key))
        return super().accept(token_id)


class LoggedGrammars:
    """`Grammars` whose spec is {"choice": ["<request id> <token ids...>"]}."""

    def __init__(self, log: list) -> None:
        self.log = log

    def matcher(self, spec: str) -> Logged:
        key, *ids = json.loads(spec)["choice"][0].split()
        return Logged([int(t) for t in ids], EOS, key, self.log)


SCRIPTS = {"a": [17, 5, 40, 42, 3, 3, 9, 11], "b": [8, 8, 8, 8, 8, 8], "c": [25, 1, 2, 3, 4, 5, 6, 7, 30]}


def constrained_items():
    ps = prompts(4)
    items = [item(rid, ps[i], temperature=1.0, max_tokens=30,
                  structured_outputs=canonical_spec({"choice": [" ".join([rid, *map(str, s)])]}))
             for i, (rid, s) in enumerate(SCRIPTS.items())]
    return ps, items + [item("free", ps[3], temperature=0.0, max_tokens=12, ignore_eos=True)]


def check_tokens(out, ps):
    for rid, script in SCRIPTS.items():
        assert tokens_of(out[rid]) == [*script, EOS], rid  # the grammar's end token closes it
    assert tokens_of(out["free"]) == reference(TinyLM(), ps[3], 12)  # a row beside them is not masked


def test_constrained_rows_run_ahead_and_matchers_take_tokens_while_the_next_forward_runs(model):
    log: list = []
    engine = make_engine(model, lookahead=True, grammars=LoggedGrammars(log), eos_token_ids=(EOS,))
    launch = engine.runner.launch_ahead

    def logged_launch(seqs, ids):
        log.append(("launch", {s.key[0] for s in seqs}))
        return launch(seqs, ids)

    engine.runner.launch_ahead = logged_launch
    ps, items = constrained_items()
    out = drive_staggered(engine, items, [0] * len(items))
    check_tokens(out, ps)
    # a token reaches its matcher after the forward it feeds was launched: the launch comes between the
    # sequence's previous accept and this one (all but each sequence's first token, sampled after prefill)
    ahead, launched = 0, set()
    for event, who in log:
        if event == "launch":
            launched |= who
        else:
            ahead += who in launched
            launched.discard(who)
    assert ahead >= sum(len(s) for s in SCRIPTS.values()) and engine.lookahead_steps > 0
    assert engine.masks.staged > max(map(len, SCRIPTS.values()))


def test_constrained_rows_are_drawn_by_the_step_graphs(model, monkeypatch):
    engine = graphed(model, monkeypatch, grammars=LoggedGrammars([]), eos_token_ids=(EOS,))
    engine.step_graphs = StepGraphs(engine.runner, engine.sampler, graph_class=EagerBatchGraphs)
    launch, constrained = engine.step_graphs.launch, []

    def counted(seqs, logits, rows):
        ahead = launch(seqs, logits, rows)
        constrained.append(ahead is not None and any(s.matcher is not None for s in seqs))
        return ahead

    engine.step_graphs.launch = counted
    ps, items = constrained_items()
    out = drive_staggered(engine, items, [0, 0, 1, 2])
    check_tokens(out, ps)
    assert sum(constrained) >= min(map(len, SCRIPTS.values())) - 2
    ids = engine.runner.decode_ids  # padding rows included: the next forward embeds them all
    assert int(ids.min()) >= 0 and int(ids.max()) < VOCAB


MIXED = {"a": [17, 5, 40, 42, 3, 3, 9, 11, 12, 13, 14], "b": [8, 8, 8, 8, 8, 8], "c": [25, 1, 2, 3, 4, 5, 6, 7, 30],
         "d": [33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45], "g": [50, 51, 52, 53]}
MIXED_OPTIONS = {"a": {"temperature": 1.0}, "b": {"temperature": 1.0, "seed": 3},  # graphs / eager (own generator)
                 "c": {"temperature": 0.7, "logprobs": 2}, "d": {"temperature": 0.0, "presence_penalty": 0.5},
                 "g": {"temperature": 0.0}}


def _engine(model, monkeypatch, mode, grammars, **kw):
    if mode == "lookahead":
        return make_engine(model, lookahead=True, max_num_seqs=8, grammars=grammars, **kw)
    engine = graphed(model, monkeypatch, grammars=grammars, **kw)
    engine.step_graphs = StepGraphs(engine.runner, engine.sampler, graph_class=EagerBatchGraphs)
    return engine


@pytest.mark.parametrize("mode", ["lookahead", "graphed"])
def test_constrained_rows_beside_eager_rows_through_preemption(model, monkeypatch, mode):
    """Constrained rows that sample eagerly (seeded, logprobs, presence penalty) and through the graphs in one
    batch with free rows (a repetition penalty, logprobs), joining and leaving at staggered steps in a pool too
    small for all (preemption): each batch row gets its own mask, graphed or eager, padded rows none."""
    ps = prompts(8)
    items = [item(rid, ps[i + 1], max_tokens=30, structured_outputs=canonical_spec({"choice": [" ".join(
             [rid, *map(str, s)])]}), **MIXED_OPTIONS[rid]) for i, (rid, s) in enumerate(MIXED.items())]
    free = [item("e", ps[6], temperature=0.0, repetition_penalty=1.4, max_tokens=14, ignore_eos=True),
            item("f", ps[7], temperature=0.0, logprobs=1, max_tokens=9, ignore_eos=True)]
    engine = _engine(model, monkeypatch, mode, LoggedGrammars([]), eos_token_ids=(EOS,), **POOL)
    out = drive_staggered(engine, items + free, [6, 0, 2, 0, 1, 8, 0])
    for rid, script in MIXED.items():
        assert tokens_of(out[rid]) == [*script, EOS], rid
    alone = drive_staggered(make_engine(model, **POOL), free, [0, 0])
    assert all(tokens_of(out[r]) == tokens_of(alone[r]) for r in "ef")  # free rows beside them are not masked
    assert engine.batch_scheduler.num_preemptions > 0 and engine.lookahead_steps > 0
    if mode == "graphed":  # both ways of drawing a constrained row were taken
        assert engine.sampler.replays > 0 and engine.step_graphs.replays > 0


WINDOW_EOS = 45


@pytest.mark.parametrize("mode", ["lookahead", "graphed"])
def test_constrained_rows_of_a_windowed_head(monkeypatch, mode):
    """Logits over a window of ids (`logit_offset` 20, 32 columns: a bitmask of 2 words whose bits start at
    id 0): the masks line up with the window's columns on every path."""
    from tests.unit.test_ar_logit_window import WindowLM
    from tests.unit.test_grammar_mask import ScriptGrammars

    window = WindowLM()
    scripts = {"a": [20, 26, 51, 30, 31], "b": [50, 50, 50], "c": [27, 28, 29, 33, 34, 35, 36, 37]}
    options = {"a": {"temperature": 1.0}, "b": {"temperature": 1.0, "seed": 3}, "c": {"temperature": 0.7, "top_p": 0.5}}
    ps = prompts(8)
    items = [item(rid, ps[i + 1], max_tokens=30, structured_outputs=canonical_spec({"choice": [" ".join(map(str, s))]}),
                  **options[rid]) for i, (rid, s) in enumerate(scripts.items())]
    free = item("f", ps[6], temperature=0.0, max_tokens=10, ignore_eos=True)
    engine = _engine(window, monkeypatch, mode, ScriptGrammars(WINDOW_EOS), eos_token_ids=(WINDOW_EOS,))
    out = drive_staggered(engine, [*items, free], [0, 1, 0, 2])
    for rid, script in scripts.items():
        assert tokens_of(out[rid]) == [*script, WINDOW_EOS], rid
    assert tokens_of(out["f"]) == tokens_of(drive_staggered(make_engine(window), [free], [0])["f"])
    assert engine.masks.words == 2


class Refuses(Script):
    """A scripted matcher whose mask allows a token that its accept then refuses (a grammar library's fault)."""

    def accept(self, token_id: int) -> bool:
        return len(self.todo) != 2 and super().accept(token_id)


class RefusingGrammars:
    """`Grammars` whose spec is {"choice": ["<refuses|ok> <token ids...>"]}."""

    def matcher(self, spec: str) -> Script:
        kind, *ids = json.loads(spec)["choice"][0].split()
        return (Refuses if kind == "refuses" else Script)([int(t) for t in ids], EOS)


def test_a_refused_token_fails_the_step_and_the_engine_serves_on(model, monkeypatch):
    """A matcher refusing a token its own mask allowed fails the step (the worker then fails the engine's
    requests and releases them) while a forward launched ahead is in flight; new constrained and free
    requests then get their tokens."""
    engine = _engine(model, monkeypatch, "graphed", RefusingGrammars(), eos_token_ids=(EOS,))

    def spec(kind, tokens):
        return canonical_spec({"choice": [" ".join([kind, *map(str, tokens)])]})

    ps = prompts(6)
    for it in (item("x", ps[1], temperature=1.0, max_tokens=30, structured_outputs=spec("refuses", [5, 6, 7, 8, 9])),
               item("y", ps[2], temperature=1.0, max_tokens=30, structured_outputs=spec("ok", [1, 2, 3, 4, 5, 6])),
               item("z", ps[3], temperature=0.0, max_tokens=30, ignore_eos=True)):
        engine.submit(replace(it, loop=LoopSpec(10_000)))
    with pytest.raises(RuntimeError, match="forbids"):
        for _ in range(100):
            engine.step()
    assert engine._ahead is not None  # the next forward was launched before the refusal
    for rid in "xyz":
        engine.release(rid)
    free = item("b", ps[5], temperature=0.0, max_tokens=8, ignore_eos=True)
    out = drive_staggered(engine, [item("a", ps[4], temperature=1.0, max_tokens=30,
                                        structured_outputs=spec("ok", [9, 10, 11, 12])), free], [0, 0])
    assert tokens_of(out["a"]) == [9, 10, 11, 12, EOS]
    assert tokens_of(out["b"]) == reference(model, ps[5], 8)
