"""Engine hooks through AutoregressiveEngine with a tiny Qwen3 (llama family): input embeddings,
explicit positions, hidden-state capture; chunked prefill, preemption and the prefix cache."""

import pytest
import torch
import torch.nn.functional as F

from mstar.engines.autoregressive import AutoregressiveEngine
from mstar.engines.base import StepItem
from mstar.engines.extras import FINAL, ForwardExtras
from mstar.engines.kv_cache.config import KVCacheConfig
from mstar.engines.sampling import SamplingParams
from mstar.models.common.loading import fill_dummy_weights
from mstar.models.llama.model import build_model
from mstar.models.llama.tiny import tiny_config


class FullAttention:
    """No cache: plain causal attention over the tokens of one full-recompute forward."""

    def forward(self, layer, q, k, v):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def model():
    m = build_model(tiny_config("qwen3"), dtype=torch.float32)
    fill_dummy_weights(m, seed=1, std=0.3)
    return m


def reference(model, ids, steps, rows=None, embeds=None, positions=None, capture=()):
    """Greedy tokens by full recompute; embeds replace rows of the prompt; `positions` of the prompt
    (default 0..n-1), generated tokens continuing from their max + 1."""
    ids, out, kept = list(ids), [], None
    pos = list(range(len(ids))) if positions is None else list(positions)
    for _ in range(steps):
        extras = ForwardExtras(capture=frozenset(capture))
        if rows is not None:
            extras.embeds, extras.embeds_rows = embeds, torch.as_tensor(rows)
        with torch.no_grad():
            h = model.forward(torch.tensor(ids), torch.tensor(pos), FullAttention(), extras)
        kept = kept or dict(extras.captured)
        token = int(model.compute_logits(h[-1:]).argmax())
        out.append(token)
        ids.append(token)
        pos.append(pos[-1] + 1)
    return out, kept


def engine_for(model, pages=64, **kw):
    kw.setdefault("default_sampling", SamplingParams(temperature=0.0))
    return AutoregressiveEngine(model, KVCacheConfig(max_num_pages=pages, page_size=4), "cpu", **kw)


def drive(engine, first_items, decode_options=None, max_steps=500):
    """Feed sampled tokens back (with `decode_options`) until each request stops; results per request."""
    results = {it.request_id: [] for it in first_items}
    for it in first_items:
        engine.submit(it)
    for _ in range(max_steps):
        if not engine.has_work():
            return results
        for r in engine.step():
            results[r.request_id].append(r)
            if r.error is None and not r.stop:
                engine.submit(StepItem(r.request_id, "g", "llm", {"input_ids": r.outputs["token"]},
                                       options=dict(decode_options or {})))
    raise AssertionError("engine did not finish")


def tokens(results):
    assert all(r.error is None for r in results), [r.error for r in results]
    return [int(r.outputs["token"]) for r in results]


def prompt(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_input_embeds_replace_masked_rows_with_chunked_prefill(model):
    ids = prompt(10)
    mask = torch.zeros(10, dtype=torch.bool)
    mask[3:7] = True
    embeds = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    want, _ = reference(model, ids, 6, rows=[3, 4, 5, 6], embeds=embeds)
    assert want != reference(model, ids, 6)[0]  # the embeddings matter
    engine = engine_for(model, max_batch_tokens=4)
    inputs = {"input_ids": torch.tensor(ids), "input_embeds": embeds, "embeds_mask": mask}
    out = drive(engine, [StepItem("a", "g", "llm", inputs, options={"max_tokens": 6})])
    assert tokens(out["a"]) == want


def test_explicit_positions_continue_into_decode_and_survive_preemption(model):
    items, wants, positions = [], [], []
    for i in range(5):
        ids = prompt(9 + i, seed=i)
        # a gap after token 4, as after an image whose tokens share positions
        positions.append(torch.cat([torch.arange(5), torch.arange(5, len(ids)) + 20 + 3 * i]))
        wants.append(reference(model, ids, 8, positions=positions[-1].tolist())[0])
        inputs = {"input_ids": torch.tensor(ids), "positions": positions[-1]}
        items.append(StepItem(f"r{i}", "g", "llm", inputs, options={"max_tokens": 8}))
    engine = engine_for(model, pages=10, max_model_len=40)
    out = drive(engine, items)
    assert engine.batch_scheduler.num_preemptions > 0
    for i in range(5):
        assert tokens(out[f"r{i}"]) == wants[i]
    assert wants[0] != reference(model, prompt(9, seed=0), 8)[0]  # the positions matter


def test_return_hidden_for_prompt_and_decode_items(model):
    ids = prompt(11, seed=3)
    want, kept = reference(model, ids, 3, capture=(0, 1, FINAL))
    engine = engine_for(model, max_batch_tokens=4)
    first = StepItem("a", "g", "llm", {"input_ids": torch.tensor(ids)},
                     options={"max_tokens": 3, "return_hidden": [0, 1, -1]})
    out = drive(engine, [first], decode_options={"return_hidden": -1})["a"]
    assert tokens(out) == want
    hidden = out[0].outputs["hidden"]
    assert hidden.shape == (3, 11, 64)
    for i, layer in enumerate((0, 1, FINAL)):
        torch.testing.assert_close(hidden[i], kept[layer], atol=1e-4, rtol=1e-4)
    # a decode item's capture is its one token: the final state that produced the next sample
    _, kept2 = reference(model, ids + want[:1], 1, capture=(FINAL,))
    torch.testing.assert_close(out[1].outputs["hidden"][0, 0], kept2[FINAL][-1], atol=1e-4, rtol=1e-4)


def test_prefix_cache_never_serves_tokens_with_embeddings_or_captures(model):
    ids = prompt(14, seed=7)
    engine = engine_for(model)
    plain = tokens(drive(engine, [StepItem("a", "g", "llm", {"input_ids": torch.tensor(ids)},
                                           options={"max_tokens": 4})])["a"])
    assert plain == reference(model, ids, 4)[0]
    # same ids, but embeddings for token 9: pages 0-1 may come from the cache, the rest may not
    embeds = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(14, dtype=torch.bool)
    mask[9] = True
    inputs = {"input_ids": torch.tensor(ids), "input_embeds": embeds, "embeds_mask": mask}
    with_embeds = tokens(drive(engine, [StepItem("b", "g", "llm", inputs, options={"max_tokens": 4})])["b"])
    want = reference(model, ids, 4, rows=[9], embeds=embeds)[0]
    assert with_embeds == want and want != plain
    # a capture needs every token of its item computed, even when their pages are cached
    out = drive(engine, [StepItem("c", "g", "llm", {"input_ids": torch.tensor(ids)},
                                  options={"max_tokens": 1, "return_hidden": [1]})])["c"]
    torch.testing.assert_close(out[0].outputs["hidden"][0], reference(model, ids, 1, capture=(1,))[1][1],
                               atol=1e-4, rtol=1e-4)


def test_malformed_extras_fail_alone(model):
    engine = engine_for(model)
    bad = [
        {"input_ids": torch.tensor([1, 2, 3]), "positions": torch.zeros(3, 3, dtype=torch.long)},  # 3 rows: llama
        {"input_ids": torch.tensor([1, 2, 3]), "input_embeds": torch.zeros(2, 64)},
        {"input_ids": torch.tensor([1, 2, 3]), "positions": torch.arange(4)},
    ]
    items = [StepItem(f"x{i}", "g", "llm", inp, options={"max_tokens": 2}) for i, inp in enumerate(bad)]
    items.append(StepItem("h", "g", "llm", {"input_ids": torch.tensor([1, 2])}, options={"return_hidden": [9]}))
    items.append(StepItem("ok", "g", "llm", {"input_ids": torch.tensor([1, 2, 3])}, options={"max_tokens": 2}))
    out = drive(engine, items)
    for rid in ("x0", "x1", "x2", "h"):
        assert out[rid][0].error is not None
    assert "[3, 3]" in out["x0"][0].error and "[3, hidden]" in out["x1"][0].error
    assert tokens(out["ok"]) == reference(model, [1, 2, 3], 2)[0]


def test_features_of_a_mixed_batch_stay_aligned_with_their_rows():
    """A batch mixing sequences with a per-row feature (deepstack) and without gets zeros for the latter."""
    from mstar.engines.autoregressive.token_inputs import _join_features

    embeds = [torch.ones(2, 4), torch.ones(3, 4), torch.ones(1, 4)]
    feats = [{"deep": torch.full((2, 3, 4), 7.0)}, {}, {"deep": torch.full((1, 3, 4), 9.0)}]
    joined = _join_features(embeds, feats, torch.device("cpu"))
    deep = joined["deep"]
    assert deep.shape == (6, 3, 4)
    assert torch.equal(deep[:2], torch.full((2, 3, 4), 7.0))
    assert torch.equal(deep[2:5], torch.zeros(3, 3, 4))  # the middle sequence carried none
    assert torch.equal(deep[5:], torch.full((1, 3, 4), 9.0))
    assert _join_features(embeds, [{}, {}, {}], torch.device("cpu")) == {}


def test_decode_row_made_on_arrival_equals_the_general_one():
    """`decode_row` of a one-token item (made from the values at hand as it arrives) says what
    `positions` and `rows_in` say, for default, explicit, 3-row and fractional positions, embeddings,
    masked-out embeddings and features."""
    from mstar.engines.autoregressive.token_inputs import ItemExtras, TokenInputs

    def general(inputs, start):
        inputs._step = None  # drop the row made on arrival: decode_row then computes it
        return inputs.decode_row(start)

    g = torch.Generator().manual_seed(0)
    inputs, start = TokenInputs(), 6
    prompt = torch.stack([torch.arange(6), torch.arange(6) * 2, torch.arange(6) + 1])  # M-RoPE-like, max 10
    inputs.add(0, 6, ItemExtras(embeds=torch.randn(6, 4, generator=g), rows=torch.arange(6), positions=prompt))
    steps = [
        ItemExtras(),  # token only: continues from the prompt's max + 1
        ItemExtras(embeds=torch.randn(1, 4, generator=g), rows=torch.arange(1)),
        ItemExtras(positions=torch.full((3, 1), 13)),  # the default position, given explicitly
        ItemExtras(positions=torch.tensor([[20], [21], [22]])),  # explicit, not the default
        ItemExtras(embeds=torch.randn(1, 4, generator=g), rows=torch.arange(1), positions=torch.tensor([[23]])),
        ItemExtras(embeds=torch.zeros(0, 4), rows=torch.zeros(0, dtype=torch.long)),  # its embedding masked out
        ItemExtras(embeds=torch.randn(1, 4, generator=g), rows=torch.arange(1),
                   features={"deep": torch.randn(1, 2, 4, generator=g)}),
        ItemExtras(positions=torch.tensor([[30.5], [31.0], [32.0]])),  # fractional (video timing)
        ItemExtras(),
    ]
    for extras in steps:
        inputs.add(start, 1, extras)
        made = inputs.decode_row(start)
        want = general(inputs, start)
        assert made.positions == want.positions, (start, made.positions, want.positions)
        assert len(made.positions) == 3  # 3 rows since the prompt
        assert (made.embed is None) == (want.embed is None) and made.has_features == want.has_features
        if made.embed is not None:
            assert torch.equal(made.embed, want.embed)
        start += 1
    assert general(inputs, 6).positions == [11.0] * 3 and general(inputs, 9).positions == [20.0, 21.0, 22.0]


def test_decode_row_of_one_row_positions_repeats_over_three_rows_once_multi_row():
    from mstar.engines.autoregressive.token_inputs import ItemExtras, TokenInputs

    inputs = TokenInputs()
    inputs.add(0, 3, ItemExtras(positions=torch.tensor([[0, 5, 9]])))  # [R, n], as parse_item makes them
    inputs.add(3, 1, ItemExtras())
    assert inputs.decode_row(3).positions == [10.0]
    inputs.add(4, 1, ItemExtras(positions=torch.tensor([[40], [41], [42]])))
    inputs.add(5, 1, ItemExtras(positions=torch.tensor([[50]])))
    made = inputs.decode_row(5)
    inputs._step = None
    assert made.positions == inputs.decode_row(5).positions == [50.0] * 3


def test_appended_positions_are_what_a_token_only_item_gets():
    """The positions of a token the engine appends (`appended_positions`, what a lookahead forward feeds)
    equal those the same token gets as a token-only item: after the last explicit ones, on every row."""
    from mstar.engines.autoregressive.token_inputs import ItemExtras, TokenInputs

    inputs = TokenInputs()
    prompt = torch.stack([torch.arange(5), torch.arange(5) * 2, torch.arange(5) + 1])  # max 8
    inputs.add(0, 5, ItemExtras(positions=prompt))
    for start in range(5, 8):
        appended = inputs.appended_positions(start)
        inputs.add(start, 1, ItemExtras(hidden_layers=(0, 2)))
        assert appended == inputs.decode_row(start).positions == [float(start + 4)] * 3


def test_ahead_hands_each_live_sequence_its_row_of_the_kept_states():
    """`hand_over` gives each sequence that asks for hidden states its batch row of the states kept by a
    forward launched ahead, also when a sequence before it left the step."""
    from mstar.engines.autoregressive.batch_scheduler import Chunk
    from mstar.engines.autoregressive.lookahead import Ahead
    from mstar.engines.autoregressive.sequence import Sequence
    from mstar.engines.autoregressive.token_inputs import ItemExtras, TokenInputs

    def seq_at(pos: int) -> Sequence:
        seq = Sequence(("r", str(pos)), SamplingParams(temperature=0.0), list(range(pos + 1)), pos, None)
        seq.inputs = TokenInputs()
        seq.inputs.add(0, pos, ItemExtras())
        seq.inputs.add(pos, 1, ItemExtras(hidden_layers=(2,)))
        return seq

    states = torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 3)  # [layers (0, 2), rows, hidden]
    gone, live = seq_at(6), seq_at(9)
    ahead = Ahead([gone, live], [6, 9], torch.zeros(2, 4), hidden=states, layers=(0, 2))
    ahead.hand_over([Chunk(live, 9, 1)], [1])
    assert torch.equal(live.inputs.take_hidden(), states[1:2, 1:2])  # layer 2 of row 1
    assert gone.inputs.take_hidden() is None
