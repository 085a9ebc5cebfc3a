"""Step graphs (engines/autoregressive/step_graph.py): a steady lookahead step's draw and next forward as one
replay, end to end on CPU through the graph stand-ins (tests/unit/graph_standins.py): the replay copies the
staged sampler and decode inputs in itself, draws into the decode id input and runs the forward, and the
tokens must equal a plain engine's while sequences join, leave, stop on length and are preempted."""

from pathlib import Path

import pytest
import torch

from mstar.engines.autoregressive import step_graph
from mstar.engines.autoregressive.step_graph import StepGraphs
from tests.interpreted import run_interpreted
from tests.unit.graph_standins import EagerBatchGraphs
from tests.unit.test_ar_engine import VOCAB, TinyLM, item, prompts, reference, tokens_of
from tests.unit.test_ar_packed_decode import POOL, drive_staggered, graphed, penalised_case

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def model():
    return TinyLM()


def with_step_graphs(model, monkeypatch, **kw):
    engine = graphed(model, monkeypatch, **kw)
    engine.step_graphs = StepGraphs(engine.runner, engine.sampler, graph_class=EagerBatchGraphs)
    return engine


def test_penalised_greedy_through_step_graphs_matches_a_plain_engine(model, monkeypatch):
    """Repetition-penalised greedy rows (a draw that does not depend on the noise: the general graph set)
    with joins, stops on length (those steps take the separate launches) and preemption."""
    ps, options, items, join_at, want = penalised_case(model)
    engine = with_step_graphs(model, monkeypatch, **POOL)
    got = drive_staggered(engine, items, join_at)
    for key in want:
        assert tokens_of(got[key]) == tokens_of(want[key]), key
    graphs = engine.step_graphs
    assert engine.batch_scheduler.num_preemptions > 0 and graphs.replays > 10
    # every replay's forward was run by the step after it, but where all its sequences had stopped
    assert engine.lookahead_steps >= graphs.replays - len(items)
    # the penalty changed what greedy picks: the seen-token masks the replays marked were read
    assert any(tokens_of(want[f"r{i}"]) != reference(model, p, o["max_tokens"])
               for i, (p, o) in enumerate(zip(ps, options)))
    ids = engine.runner.decode_ids  # padding rows included: the next forward embeds them all
    assert int(ids.min()) >= 0 and int(ids.max()) < VOCAB


def test_filtered_rows_take_the_filtered_set(model, monkeypatch):
    """top_k=1 at temperature 1 samples under a filter (the filtered graph set) and draws the argmax: the
    tokens equal greedy decoding; the step graphs served most steps."""
    ps = prompts(4)
    items = [item(f"r{i}", p, temperature=1.0, top_k=1, max_tokens=20) for i, p in enumerate(ps)]
    engine = with_step_graphs(model, monkeypatch)
    calls = {False: 0, True: 0}
    for filtered, graphs in engine.step_graphs._graphs.items():
        real = graphs.fn

        def counted(*args, real=real, filtered=filtered):
            calls[filtered] += 1
            return real(*args)
        graphs.fn = counted
    out = drive_staggered(engine, items, [0, 0, 1, 3])
    for i, p in enumerate(ps):
        assert tokens_of(out[f"r{i}"]) == reference(model, p, 20)
    assert calls[True] == engine.step_graphs.replays > 10 and calls[False] == 0


def test_copy_pairs_moves_each_span():
    a, b = torch.arange(10, dtype=torch.int32), torch.zeros(10, dtype=torch.int32)
    c, d = torch.arange(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    step_graph.copy_pairs([(a, b), (c, d)])
    assert b.tolist() == list(range(10)) and d.tolist() == [0, 1, 2]


def test_copy_words_kernel_interpreted():
    pytest.importorskip("triton")
    proc = run_interpreted(Path(__file__).with_name("host_copy_check.py"))
    assert proc.returncode == 0 and "host_copy ok" in proc.stdout, proc.stdout + proc.stderr
