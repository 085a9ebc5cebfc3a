"""Decode steps with extras through ExtrasGraphs (engines/autoregressive/extras_graph.py), on CPU: the
captured function runs eagerly in place of a CUDA graph, so what is tested is everything around the
capture (which batches qualify, staged ids, float positions, the embedding mask, hidden capture
handed back per sequence). Outputs must equal the eager extras path's."""

import pytest
import torch

from mstar.engines.autoregressive import extras_graph, runner
from mstar.engines.autoregressive.extras_graph import ExtrasGraphs
from mstar.engines.base import StepItem
from tests.unit.test_ar_token_inputs import drive, engine_for, tokens

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


class EagerGraphs:
    """Stands in for BatchGraphs on CPU: same interface, runs the function eagerly, counts calls."""

    def __init__(self, fn, sizes, example, device, before_capture=None, warmup=2, static_inputs=None):
        self.fn, self.sizes, self.calls = fn, sorted(sizes), 0

    @property
    def max_batch(self):
        return self.sizes[-1]

    def bucket(self, batch):
        return next((s for s in self.sizes if s >= batch), None)

    def __call__(self, *inputs, bucket=None):
        self.calls += 1
        with torch.inference_mode():
            return self.fn(*inputs)


class PadTolerant:
    """The SDPA backend with the graph-facing surface (`GraphedAttention`: pad_to, max_num_seqs,
    max_pages_per_seq); EagerGraphs runs unpadded batches, so padding is not needed."""

    max_num_seqs = 256

    def __init__(self, inner, max_pages):
        self.inner, self.max_pages_per_seq = inner, max_pages

    def prepare(self, meta, pad_to=None):
        self.inner.prepare(meta)

    def forward(self, *args):
        return self.inner.forward(*args)


@pytest.fixture()
def model():
    from mstar.models.common.loading import fill_dummy_weights
    from mstar.models.llama.model import build_model
    from mstar.models.llama.tiny import tiny_config

    config = tiny_config("qwen3")
    m = build_model(config, dtype=torch.float32)
    fill_dummy_weights(m, seed=1, std=0.3)
    m.hidden_size, m.graph_hidden_layers = config.hidden_size, (0, -1)
    return m


def graphed_engine(model, monkeypatch):
    engine = engine_for(model, lookahead=False)
    r = engine.runner
    r.attn = PadTolerant(r.attn, 64)
    monkeypatch.setattr(runner, "BatchGraphs", EagerGraphs)
    monkeypatch.setattr(extras_graph, "BatchGraphs", EagerGraphs)
    r.graphs = r._capture([1, 2, 4])
    r.extras_graphs = ExtrasGraphs(model, r.attn, r.device)
    r.extras_graphs.capture([1, 2, 4], r._describe_dummy_batch)
    return engine


def _requests(hidden_size):
    g = torch.Generator().manual_seed(3)
    items = []
    for i, n in enumerate((5, 9, 7)):
        ids = torch.randint(0, 200, (n,), generator=g)
        inputs = {"input_ids": ids}
        if i != 1:  # embeddings replace two prompt rows of requests 0 and 2
            mask = torch.zeros(n, dtype=torch.bool)
            mask[1:3] = True
            inputs |= {"input_embeds": torch.randn(2, hidden_size, generator=g), "embeds_mask": mask}
        if i == 2:  # a position gap, as after an image
            inputs["positions"] = torch.cat([torch.arange(3), torch.arange(3, n) + 11])
        items.append(StepItem(f"r{i}", "g", "llm", inputs, options={"max_tokens": 6}))
    return items


def test_decode_with_extras_replays_and_matches_eager(model, monkeypatch):
    decode = {"return_hidden": [0, -1]}
    want = drive(engine_for(model), _requests(model.hidden_size), decode_options=decode)
    engine = graphed_engine(model, monkeypatch)
    got = drive(engine, _requests(model.hidden_size), decode_options=decode)
    assert engine.runner.extras_graphs.graphs.calls >= 5  # every decode step of the batch took it
    for rid in want:
        assert tokens(got[rid]) == tokens(want[rid])
        for g, w in zip(got[rid][1:], want[rid][1:]):  # decode results carry [2, 1, H] states
            assert g.outputs["hidden"].shape == (2, 1, model.hidden_size)
            torch.testing.assert_close(g.outputs["hidden"], w.outputs["hidden"], rtol=1e-5, atol=1e-5)


def test_embedding_rows_in_decode_items_replay(model, monkeypatch):
    """Talker-like decode: each fed token comes with an embedding that replaces its lookup."""
    g = torch.Generator().manual_seed(5)
    feeds = [torch.randn(1, model.hidden_size, generator=g) for _ in range(8)]

    def run(engine):
        engine.submit(StepItem("t", "g", "llm", {"input_ids": torch.arange(4)}, options={"max_tokens": 6}))
        out, step = [], 0
        while engine.has_work():
            for r in engine.step():
                out.append(r)
                if not r.stop:
                    engine.submit(StepItem("t", "g", "llm", {"input_ids": r.outputs["token"],
                                                             "input_embeds": feeds[step]},
                                           options={"return_hidden": -1}))
                    step += 1
        return out

    want = run(engine_for(model))
    engine = graphed_engine(model, monkeypatch)
    got = run(engine)
    assert tokens(got) == tokens(want) and engine.runner.extras_graphs.graphs.calls == 5
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a.outputs["hidden"], b.outputs["hidden"], rtol=1e-5, atol=1e-5)


def test_undeclared_layer_runs_eagerly(model, monkeypatch):
    engine = graphed_engine(model, monkeypatch)
    items = _requests(model.hidden_size)[:1]
    out = drive(engine, items, decode_options={"return_hidden": [1]})["r0"]
    assert engine.runner.extras_graphs.graphs.calls == 0 and len(out) == 6
    assert out[-1].outputs["hidden"].shape == (1, 1, model.hidden_size)
