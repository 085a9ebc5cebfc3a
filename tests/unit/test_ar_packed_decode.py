"""Graphed decode steps through the packed decode inputs (engines/autoregressive/decode_inputs.py) and
the sampler graphs' packed inputs and seen-token rows (engines/sampling_graph.py), end to end on CPU.

The graphs are `EagerBatchGraphs` (a replay's view of the inputs: the whole padded bucket, shared
static inputs) and attention is `SharedSDPA` (a staged decode batch read back from the buffers it
shares with the packed inputs, as the Triton kernels read it). With lookahead on, sequences joining
and leaving, pages growing and preemption, the tokens must equal the reference / a plain engine's.
"""

from dataclasses import replace

import pytest
import torch

from mstar.engines import sampling_graph
from mstar.engines.autoregressive import runner as runner_module
from mstar.engines.base import LoopSpec
from mstar.engines.sampling_graph import SamplerGraphs
from tests.unit.graph_standins import EagerBatchGraphs, SharedSDPA
from tests.unit.test_ar_engine import VOCAB, TinyLM, item, make_engine, prompts, reference, tokens_of

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

SIZES = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def model():
    return TinyLM()


def graphed(model, monkeypatch, pages=64, max_model_len=None, sampler=True, **kw):
    engine = make_engine(model, pages=pages, max_model_len=max_model_len, lookahead=True, max_num_seqs=8, **kw)
    r = engine.runner
    r.attn = SharedSDPA(model.kv_layout, pages, r.page_size, "cpu", max_num_seqs=8,
                        max_pages_per_seq=-(-engine.max_model_len // r.page_size))
    monkeypatch.setattr(runner_module, "BatchGraphs", EagerBatchGraphs)
    r.graphs = r._capture(SIZES)
    if sampler:
        monkeypatch.setattr(sampling_graph, "BatchGraphs", EagerBatchGraphs)
        engine.sampler = SamplerGraphs(SIZES, torch.device("cpu"), engine.logit_offset,
                                       logits=r.logits_out, ids=r.decode_ids, masks=engine.masks)  # as the engine builds it
    return engine


def drive_staggered(engine, items, join_at, max_steps=3000):
    """Each of `items` as an engine loop (as decode walks run), submitted at step join_at[i]; results."""
    results = {it.request_id: [] for it in items}
    for step in range(max_steps):
        for it, at in zip(items, join_at):
            if at == step:
                engine.submit(replace(it, loop=LoopSpec(10_000)))
        if step > max(join_at) and not engine.has_work():
            return results
        for r in engine.step():
            assert r.error is None, r.error
            results[r.request_id].append(r)
    raise AssertionError("engine did not finish")


def test_greedy_batches_read_everything_from_the_packed_buffer(model, monkeypatch):
    ps = prompts(8)
    engine = graphed(model, monkeypatch, sampler=False)
    items = [item(f"r{i}", p, max_tokens=6 + 2 * i) for i, p in enumerate(ps)]
    out = drive_staggered(engine, items, [0, 0, 1, 3, 3, 7, 8, 12])
    for i, p in enumerate(ps):
        assert tokens_of(out[f"r{i}"]) == reference(model, p, 6 + 2 * i)
    r = engine.runner
    assert r._shared_attn is r.attn and r.attn.staged > 20 and engine.lookahead_steps > 10
    assert r.graphs.calls == r.attn.staged and r.graphs.copies == 0  # every input came with the packed copy


POOL = {"pages": 14, "max_model_len": 56}  # too small for all of `penalised_case`'s sequences at once


def penalised_case(model):
    """Six repetition-penalised greedy requests (a draw that does not depend on the noise) joining at
    staggered steps, for an engine with `POOL` (preemption): (prompts, options, items, join steps, a plain
    engine's results)."""
    ps = prompts(8)[1:7]
    options = [{"temperature": 0.0, "repetition_penalty": 1.5 + 0.1 * i, "max_tokens": 12 + 3 * i}
               for i in range(len(ps))]
    items = [item(f"r{i}", p, **o) for i, (p, o) in enumerate(zip(ps, options))]
    join_at = [0, 0, 2, 5, 9, 14]
    return ps, options, items, join_at, drive_staggered(make_engine(model, **POOL), items, join_at)


def test_sampler_graphs_and_preemption_match_a_plain_engine(model, monkeypatch):
    """Repetition-penalised greedy rows through the sampler graphs' seen-token rows, with joins, leaves and
    preemption (a pool too small for all)."""
    ps, options, items, join_at, want = penalised_case(model)
    engine = graphed(model, monkeypatch, **POOL)
    got = drive_staggered(engine, items, join_at)
    for key in want:
        assert tokens_of(got[key]) == tokens_of(want[key]), key
    assert engine.batch_scheduler.num_preemptions > 0 and engine.sampler.replays > 20
    assert engine.runner.attn.staged > 20 and engine.lookahead_steps > 0
    # decode graphs leave their logits where the sampler graphs read them, and those write the ids the
    # lookahead forward reads: only prefill steps' logits and shrinking batches' ids are copied
    sampler, runner = engine.sampler, engine.runner
    assert runner.logits_out is not None and sampler._logits[1].data_ptr() == runner.logits_out.data_ptr()
    assert sampler.logit_copies < sampler.replays / 2, (sampler.logit_copies, sampler.replays)
    assert runner.ids_copies < engine.lookahead_steps / 2, (runner.ids_copies, engine.lookahead_steps)
    ids = runner.decode_ids  # padding rows included: the next forward embeds them all
    assert int(ids.min()) >= 0 and int(ids.max()) < VOCAB
    # the penalty changed what greedy picks: the masks were read, not just carried along
    assert any(tokens_of(want[f"r{i}"]) != reference(model, p, o["max_tokens"])
               for i, (p, o) in enumerate(zip(ps, options)))
