"""AutoregressiveEngine against a full-recompute reference on a tiny 2-layer transformer."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mstar.engines.autoregressive import AutoregressiveEngine
from mstar.engines.base import CausalLMBase, KVLayout, LoopSpec, StepItem
from mstar.engines.kv_cache.config import KVCacheConfig
from mstar.engines.sampling import SamplingParams

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS = 61, 32, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS


def _rope(x, positions):
    half = HEAD_DIM // 2
    freqs = positions[:, None].to(x.dtype) / (100.0 ** (torch.arange(half, dtype=x.dtype) / half))
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class TinyLM(CausalLMBase, nn.Module):
    """Follows the CausalLM contract; float64 so that cache/no-cache paths agree to the last bit of argmax."""

    hidden_size = HIDDEN
    logit_width = VOCAB

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.kv_layout = KVLayout(LAYERS, KV_HEADS, HEAD_DIM, torch.float64)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.qkv = nn.ModuleList(nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM) for _ in range(LAYERS))
        self.out = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, 64), nn.GELU(), nn.Linear(64, HIDDEN))
                                 for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.double()
        self.tokens_seen = []  # new tokens per forward call, to check chunking and cache hits

    def forward(self, input_ids, positions, attn):
        self.tokens_seen.append(len(input_ids))
        x = self.embed(input_ids)
        for i in range(LAYERS):
            q, k, v = self.qkv[i](F.layer_norm(x, (HIDDEN,))).split(
                [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            q = _rope(q.view(-1, HEADS, HEAD_DIM), positions)
            k = _rope(k.view(-1, KV_HEADS, HEAD_DIM), positions)
            x = x + self.out[i](attn.forward(i, q, k, v.view(-1, KV_HEADS, HEAD_DIM)).reshape(-1, HIDDEN))
            x = x + self.mlp[i](F.layer_norm(x, (HIDDEN,)))
        return F.layer_norm(x, (HIDDEN,))

    def compute_logits(self, hidden, input_ids=None, out=None):
        return (3.0 * self.head(hidden)).float()


class DenseAttention:
    """Reference attention for one unpaged sequence: plain causal attention, no cache."""

    def forward(self, layer, q, k, v):
        rep = HEADS // KV_HEADS
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                             v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)


@pytest.fixture(scope="module")
def model():
    return TinyLM()


@torch.no_grad()
def reference(model, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        hidden = model.forward(torch.tensor(tokens), torch.arange(len(tokens)), DenseAttention())
        tokens.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return tokens[len(prompt):]


def make_engine(model, pages=64, page_size=4, **kw):
    kw.setdefault("default_sampling", SamplingParams(temperature=0.0))
    return AutoregressiveEngine(model, KVCacheConfig(max_num_pages=pages, page_size=page_size), "cpu", **kw)


def item(rid, tokens, slot="main", **options):
    # One node per KV slot, as a guidance model would have: results name the node, not the slot.
    return StepItem(rid, "generate", f"llm_{slot}", {"input_ids": torch.as_tensor(tokens, dtype=torch.long)},
                    options=options, kv_slot=slot)


def drive(engine, items, max_steps=2000, feed=lambda token: token, loop=False):
    """Act as the worker: feed `feed(sampled token)` back until the item says stop; collect results.
    With `loop`, each item is an engine loop instead (the engine appends its samples) that ends only
    on a stop: nothing is fed back."""
    if loop:
        items = [replace(it, loop=LoopSpec(10_000)) for it in items]
    results = {(it.request_id, it.kv_slot): [] for it in items}
    for it in items:
        engine.submit(it)
    for _ in range(max_steps):
        if not engine.has_work():
            return results
        for r in engine.step():
            slot = r.node.removeprefix("llm_")
            results.setdefault((r.request_id, slot), []).append(r)
            assert r.more == (loop and r.error is None and not r.stop), r
            if r.error is None and not r.stop and not loop:
                engine.submit(item(r.request_id, feed(r.outputs["token"]), slot))
    raise AssertionError("engine did not finish")


def tokens_of(results):
    return [int(r.outputs["token"]) for r in results]


def prompts(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 3, 4, 7, 12, 17, 22, 30][:n]
    return [torch.randint(0, VOCAB, (length,), generator=g).tolist() for length in lengths]


def test_single_request_matches_reference(model):
    prompt = prompts(8)[5]
    engine = make_engine(model)
    out = drive(engine, [item("a", prompt, max_tokens=12)])[("a", "main")]
    assert tokens_of(out) == reference(model, prompt, 12)
    assert [r.stop for r in out] == [False] * 11 + [True] and out[-1].finish_reason == "length"


@pytest.mark.parametrize("max_batch_tokens", [2048, 8])
def test_batched_mixed_lengths_match_reference(model, max_batch_tokens):
    ps = prompts(8)
    engine = make_engine(model, max_batch_tokens=max_batch_tokens)
    model.tokens_seen.clear()
    out = drive(engine, [item(f"r{i}", p, max_tokens=6 + i) for i, p in enumerate(ps)])
    seen = list(model.tokens_seen)
    for i, p in enumerate(ps):
        assert tokens_of(out[(f"r{i}", "main")]) == reference(model, p, 6 + i)
    assert max(seen) == min(max_batch_tokens, sum(len(p) for p in ps))  # all prompts in one step if allowed
    if max_batch_tokens == 8:  # 96 prompt tokens in chunks of at most 8
        assert seen.count(8) >= 12


def test_prefix_cache_hits_skip_work_and_keep_outputs(model):
    shared = prompts(8, seed=3)[7][:24]  # 6 full pages of 4
    engine = make_engine(model)
    first = drive(engine, [item("a", shared + [5, 6], max_tokens=5)])[("a", "main")]
    model.tokens_seen.clear()
    second = drive(engine, [item("b", shared + [5, 6], max_tokens=5)])[("b", "main")]
    third = drive(engine, [item("c", shared + [9], max_tokens=5)])[("c", "main")]
    assert tokens_of(first) == tokens_of(second) == reference(model, shared + [5, 6], 5)
    assert tokens_of(third) == reference(model, shared + [9], 5)
    assert model.tokens_seen[0] == 2  # 24 cached tokens skipped for "b"
    assert model.tokens_seen[5] == 1  # ... and for "c"


def test_preemption_when_pages_run_out(model):
    ps = prompts(8)[2:8]
    # 12 pages of 4 tokens hold 48 tokens; the six requests need about 130 at their longest.
    engine = make_engine(model, pages=12, max_model_len=48)
    out = drive(engine, [item(f"r{i}", p, max_tokens=10) for i, p in enumerate(ps)])
    assert engine.batch_scheduler.num_preemptions > 0
    for i, p in enumerate(ps):
        assert tokens_of(out[(f"r{i}", "main")]) == reference(model, p, 10)
    for i in range(len(ps)):
        engine.release(f"r{i}")
    assert engine.pool.num_free == 12 and all(engine.pool.refcount(p) == 0 for p in range(12))


def test_kv_slots_are_separate_sequences(model):
    ps = prompts(8)
    engine = make_engine(model)
    out = drive(engine, [item("g", ps[4], "cond", max_tokens=4), item("g", ps[6], "uncond", max_tokens=4)])
    assert tokens_of(out[("g", "cond")]) == reference(model, ps[4], 4)
    assert tokens_of(out[("g", "uncond")]) == reference(model, ps[6], 4)
    engine.submit(item("g", ps[1], "cond"))
    engine.release("g")
    assert not engine.has_work() and engine.pool.num_free == 64


def test_eos_stop_min_tokens_and_ignore_eos(model):
    prompt = prompts(8)[4]
    ref = reference(model, prompt, 8)
    eos = ref[2]
    first_eos = ref.index(eos)
    engine = make_engine(model, eos_token_ids=(eos,))
    out = drive(engine, [item("a", prompt, max_tokens=8)])[("a", "main")]
    assert tokens_of(out) == ref[: first_eos + 1] and out[-1].finish_reason == "stop"
    out = drive(engine, [item("b", prompt, max_tokens=8, ignore_eos=True)])[("b", "main")]
    assert tokens_of(out) == ref and out[-1].finish_reason == "length"
    out = drive(engine, [item("c", prompt, max_tokens=8, min_tokens=first_eos + 2)])[("c", "main")]
    assert eos not in tokens_of(out)[: first_eos + 2]
    out = drive(engine, [item("d", prompt, max_tokens=8, stop_token_ids=[ref[1]])])[("d", "main")]
    assert tokens_of(out) == ref[: ref.index(ref[1]) + 1] and out[-1].finish_reason == "stop"


@pytest.mark.parametrize("max_batch_tokens", [2048, 8])
def test_engine_loops_append_their_own_samples(model, max_batch_tokens):
    """Engine-loop items give the tokens, stops and finish reasons of items fed back one token at a time,
    with stops (eos, max_tokens) and preemption; every result but the last has more=True."""
    ps = prompts(8)[2:8]
    eos = reference(model, ps[1], 8)[4]
    items = [item(f"r{i}", p, max_tokens=6 + i) for i, p in enumerate(ps)]
    kw = {"pages": 12, "max_model_len": 48, "max_batch_tokens": max_batch_tokens, "eos_token_ids": (eos,)}
    fed, looped = make_engine(model, **kw), make_engine(model, **kw)
    expected, out = drive(fed, items), drive(looped, items, loop=True)
    assert {k: tokens_of(v) for k, v in out.items()} == {k: tokens_of(v) for k, v in expected.items()}
    assert {k: v[-1].finish_reason for k, v in out.items()} == {k: v[-1].finish_reason for k, v in expected.items()}
    assert any(v[-1].finish_reason == "stop" for v in out.values())
    assert looped.batch_scheduler.num_preemptions == fed.batch_scheduler.num_preemptions > 0
    assert looped.pool.num_used == 0 and not looped._seqs


def test_an_engine_loop_ends_at_its_bound_and_the_sequence_goes_on(model):
    """A loop of 3 iterations: 3 results, the last with more=False and no stop; the sequence keeps its
    tokens (the engine appended two of them) and a later item continues it, as a walk's next loop does."""
    prompt = prompts(8)[5]
    ref = reference(model, prompt, 7)
    engine = make_engine(model)
    engine.submit(replace(item("a", prompt, max_tokens=7), loop=LoopSpec(3)))
    out = []
    while engine.has_work():
        out += engine.step()
    assert tokens_of(out) == ref[:3] and [r.more for r in out] == [True, True, False]
    assert not out[-1].stop and out[-1].finish_reason is None
    assert engine._seqs[("a", "main")].token_ids == prompt + ref[:2]  # the third is the caller's to feed
    engine.submit(replace(item("a", ref[2:3], max_tokens=7), loop=LoopSpec(10)))
    rest = []
    while engine.has_work():
        rest += engine.step()
    assert tokens_of(rest) == ref[3:] and rest[-1].finish_reason == "length" and not rest[-1].more


def test_context_limit_ends_with_length(model):
    engine = make_engine(model, max_model_len=10)
    out = drive(engine, [item("a", [1, 2, 3, 4, 5, 6])])[("a", "main")]
    assert len(out) == 4 and out[-1].finish_reason == "length"


def test_bad_items_fail_alone(model):
    engine = make_engine(model, max_model_len=32)
    good = item("ok", [1, 2, 3], max_tokens=3)
    bad = [item("neg", [1], max_tokens=-1), item("long", list(range(40))), item("over", [1, 2], max_tokens=31),
           StepItem("empty", "generate", "llm_main", {"input_ids": torch.zeros(0, dtype=torch.long)})]
    out = drive(engine, [good, *bad])
    assert len(out[("ok", "main")]) == 3 and out[("ok", "main")][-1].error is None
    for b in bad:
        (r,) = out[(b.request_id, "main")]
        assert r.error and "token" not in r.outputs
    assert "max_tokens=-1" in out[("neg", "main")][0].error
    assert "max_model_len=32" in out[("over", "main")][0].error


def test_seeded_request_same_alone_and_batched(model):
    ps = prompts(8)
    opts = {"temperature": 1.0, "seed": 1234, "max_tokens": 8}
    alone = drive(make_engine(model), [item("s", ps[5], **opts)])[("s", "main")]
    others = [item(f"o{i}", p, temperature=1.0, max_tokens=5) for i, p in enumerate(ps)]
    batched = drive(make_engine(model), [*others[:3], item("s", ps[5], **opts), *others[3:]])[("s", "main")]
    assert tokens_of(alone) == tokens_of(batched)


def test_logprobs_outputs(model):
    engine = make_engine(model)
    (r, *_) = drive(engine, [item("a", [1, 2, 3], max_tokens=2, logprobs=3)])[("a", "main")]
    assert r.outputs["logprob"].shape == (1,) and r.outputs["top_ids"].shape == (3,)
    assert int(r.outputs["top_ids"][0]) == int(r.outputs["token"])  # greedy picks the top alternative
    assert torch.allclose(r.outputs["logprob"], r.outputs["top_logprobs"][:1])


def test_idle_sequences_give_way_to_waiting_ones(model):
    # "a" holds 8 of 10 pages while its caller holds back its next token (e.g. waiting for another
    # guidance branch); "b" needs 5 pages: the idle "a" must be preempted, then recompute correctly.
    ps = prompts(8, seed=5)
    engine = make_engine(model, pages=10, max_model_len=40)
    engine.submit(item("a", ps[7], max_tokens=3))  # 30 tokens -> 8 pages
    (first,) = engine.step()
    out = drive(engine, [item("b", ps[5], max_tokens=2)])  # 17 tokens -> 5 pages
    assert tokens_of(out[("b", "main")]) == reference(model, ps[5], 2)
    assert engine.batch_scheduler.num_preemptions == 1
    out = drive(engine, [item("a", first.outputs["token"])])
    assert tokens_of([first, *out[("a", "main")]]) == reference(model, ps[7], 3)


def test_warm_up_leaves_no_sequences_behind():
    """The warm-up (on by default on CUDA) runs prompts through prefill and decode and forgets them."""
    from mstar.config import KVCacheConfig
    from mstar.engines.autoregressive.engine import AutoregressiveEngine
    from mstar.models.common.loading import fill_dummy_weights
    from mstar.models.llama.config import LlamaConfig
    from mstar.models.llama.model import build_model
    from mstar.models.llama.tiny import tiny_hf_config

    model = build_model(LlamaConfig.from_hf(tiny_hf_config("llama")), torch.float32)
    fill_dummy_weights(model)
    rows = []
    forward = model.forward
    model.forward = lambda ids, *args, **kw: rows.append(len(ids)) or forward(ids, *args, **kw)
    engine = AutoregressiveEngine(model, KVCacheConfig(max_num_pages=32, page_size=4), "cpu", warm_up=True)
    # one prefill per GEMM row bucket (8/16/32/64: no request pays a per-shape timing), then a batch
    prefills = [n for n in rows if n > 3]
    assert prefills == [5, 12, 24, 48, 54, 54], rows  # the batch once greedy, once sampled
    assert not engine.has_work() and not engine._seqs
    assert engine.pool.num_used == 0
    assert engine.pool.num_cached_idle > 0  # it did run: the prompts' full pages stay in the prefix cache
