"""A sequence streamed between two autoregressive engines while it is computed (`KVHandoff`: submit_streamed,
reserve_kv, stream_kv, place_kv, submit_with_kv) continues as on one engine, computes no prompt token on the
receiver, sends each layer before the forward computes the next, sends only the tokens the receiver's prefix
cache lacks; an offer the receiver has no room for waits until pages free, and only one larger than its whole
pool is declined (the receiver then recomputes); nothing leaks."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from mstar.engines.base import LoopSpec, StepItem
from mstar.engines.kv_handoff import KVHandoff, KVOffer, KVPositions, KVStreamEnd
from tests.unit.test_ar_engine import LAYERS, TinyLM, make_engine, prompts


@pytest.fixture(scope="module")
def model():
    return TinyLM()


class Wire:
    """The sender engine's sink, delivering to the receiver engine at once (as KVMoves does over the
    transport); it records what it sent."""

    def __init__(self, receiver, rid: str, events: list | None = None) -> None:
        self.receiver, self.rid, self.events = receiver, rid, events if events is not None else []
        self.done: KVStreamEnd | None = None
        self.tokens_sent = 0

    def layer(self, layer, start, k, v):
        self.events.append(("sent", layer))
        self.tokens_sent += len(k) if layer == 0 else 0
        self.receiver.place_kv(self.rid, "main", layer, start, k, v)

    def end(self, done):
        self.done = done


def _run(engine) -> list[int]:
    """Drive one engine-loop item to its end; its sampled tokens."""
    out = []
    while engine.has_work():
        for r in engine.step():
            assert r.error is None, r.error
            out.append(int(r.outputs["token"]))
    return out


def _prefill_item(rid: str, prompt: list[int], **options) -> StepItem:
    return StepItem(rid, "prefill", "llm", {"input_ids": torch.tensor(prompt)}, options)


def _decode_item(rid: str, prompt: list[int], first: int, steps: int, **options) -> StepItem:
    return StepItem(rid, "decode", "llm", {"input_ids": torch.tensor([first]), "prompt_ids": torch.tensor(prompt)},
                    options, loop=LoopSpec(steps))


def _one_engine(model, prompt, steps, **options) -> list[int]:
    engine = make_engine(model)
    engine.submit(_prefill_item("r", prompt, **options))
    (result,) = engine.step()
    first = int(result.outputs["token"])
    engine.submit(replace(_decode_item("r", prompt, first, steps, **options), inputs={"input_ids": torch.tensor([first])}))
    return [first, *_run(engine)]


def _kept(why: str) -> None:
    """The `withdrawn` of an offer the test expects to be granted."""
    raise AssertionError(f"offer withdrawn: {why}")


def _reserve(b, rid, offer) -> int | None:
    """b's answer to `offer` if it took pages at once: the leading tokens it held; None when it declined."""
    granted: list[int] = []
    if not b.reserve_kv(rid, "main", offer, granted.append, _kept):
        return None
    (skip,) = granted
    return skip


def _stream(a, b, rid, prompt, wire=None, **options) -> tuple[Wire, int | None, int]:
    """Offer `prompt`'s sequence from `a` to `b` and prefill it on `a`; the wire, b's answer, the first token."""
    wire = wire or Wire(b, rid)
    offer = a.submit_streamed(_prefill_item(rid, prompt, **options), wire)
    assert offer is not None and offer.tokens == prompt
    assert not a.step()  # the sequence waits for the receiver's answer
    skip = _reserve(b, rid, offer)
    a.stream_kv(rid, "main", skip)
    results = []
    while a.has_work():
        results += a.step()
    (result,) = results
    return wire, skip, int(result.outputs["token"])


@pytest.mark.parametrize("options", [{"temperature": 0.0, "ignore_eos": True},
                                     {"temperature": 1.0, "seed": 7, "ignore_eos": True, "frequency_penalty": 0.5}])
@pytest.mark.parametrize("max_batch_tokens", [2048, 8])  # one forward, or chunks of 8 tokens
def test_streamed_sequence_continues_as_on_one_engine(model, options, max_batch_tokens):
    prompt = prompts(8)[-1]  # 30 tokens: 7 full pages of 4 and a partial one
    want = _one_engine(model, prompt, 6, **options)
    a, b = make_engine(model, max_batch_tokens=max_batch_tokens), make_engine(model)
    assert isinstance(a, KVHandoff)
    wire, skip, first = _stream(a, b, "r", prompt, **options)
    assert skip == 0 and wire.tokens_sent == len(prompt) and wire.done is not None
    assert wire.done.tokens == prompt and len(wire.done.page_hashes) == 7
    assert a.stats()["kv_pages_used"] == 0 and a.stats()["kv_pages_sent"] == 8  # forgotten on a
    b.submit_with_kv(_decode_item("r", prompt, first, 6, **options), wire.done)
    assert [first, *_run(b)] == want
    stats = b.stats()
    assert stats["prompt_tokens"] == 0 and stats["kv_pages_received"] == 8 and stats["kv_pages_reused"] == 0
    b.release("r")
    assert b.stats()["kv_pages_used"] == 0


def test_each_layer_leaves_before_the_forward_computes_the_next(model):
    events: list[tuple[str, int]] = []
    hooks = [model.qkv[i].register_forward_hook(lambda m, args, out, i=i: events.append(("computed", i)))
             for i in range(LAYERS)]
    try:
        a, b = make_engine(model), make_engine(model)
        _stream(a, b, "r", prompts(8)[-1], Wire(b, "r", events), temperature=0.0)
    finally:
        for hook in hooks:
            hook.remove()
    # one forward: layer i's K/V go right after its attention wrote them, before layer i + 1 starts
    assert events == [e for i in range(LAYERS) for e in (("computed", i), ("sent", i))]


def test_tokens_the_receiver_caches_do_not_travel(model):
    prompt = prompts(8)[-1]
    want = _one_engine(model, prompt, 4, temperature=0.0, ignore_eos=True)
    a, b = make_engine(model), make_engine(model)
    for rid in ("r1", "r2"):  # the second time b's prefix cache holds the prompt's 7 full pages
        wire, skip, first = _stream(a, b, rid, prompt, temperature=0.0, ignore_eos=True)
        b.submit_with_kv(_decode_item(rid, prompt, first, 4, temperature=0.0, ignore_eos=True), wire.done)
        assert [first, *_run(b)] == want
        b.release(rid)
    assert skip == 28 and wire.tokens_sent == 2
    stats = b.stats()
    assert stats["kv_pages_reused"] == 7 and stats["kv_pages_received"] == 8 + 1 and stats["prompt_tokens"] == 0
    assert a.stats()["kv_pages_sent"] == 9 and stats["kv_pages_used"] == 0


def test_an_offer_waits_for_pages_another_request_frees(model):
    prompt, other = prompts(8)[-1], prompts(8)[-2]
    opts = {"temperature": 0.0, "ignore_eos": True}
    want = _one_engine(model, prompt, 4, **opts)
    a, b = make_engine(model), make_engine(model, pages=6 + 7)  # "busy" takes 6 pages: 7 stay free, r needs 8
    b.submit(replace(_prefill_item("busy", other, max_tokens=3, **opts), loop=LoopSpec(3)))
    b.step()
    wire, granted = Wire(b, "r"), []
    assert b.reserve_kv("r", "main", a.submit_streamed(_prefill_item("r", prompt, **opts), wire), granted.append,
                        _kept)
    assert not granted and b.kv.queued and b.stats()["kv_pages_used"] == 6  # queued, nothing taken
    assert not a.step() and not a.has_work()  # r computes nothing until the answer
    _run(b)  # "busy" ends at max_tokens: its pages free and r's offer takes them
    assert granted == [0] and not b.kv.queued and b.stats()["kv_pages_used"] == 8
    a.stream_kv("r", "main", granted[0])
    (result,) = [r for _ in range(3) for r in a.step()]
    first = int(result.outputs["token"])
    b.submit_with_kv(_decode_item("r", prompt, first, 4, **opts), wire.done)
    assert [first, *_run(b)] == want and b.stats()["prompt_tokens"] == len(other)
    b.release("r")
    assert a.stats()["kv_pages_used"] == 0 and b.stats()["kv_pages_used"] == 0


def test_an_offer_released_while_queued_leaves_nothing(model):
    prompt, other = prompts(8)[-1], prompts(8)[-2]
    opts = {"temperature": 0.0, "ignore_eos": True}
    a, b = make_engine(model), make_engine(model, pages=6 + 7)
    b.submit(replace(_prefill_item("busy", other, max_tokens=3, **opts), loop=LoopSpec(3)))
    b.step()
    granted: list[int] = []
    assert b.reserve_kv("r", "main", a.submit_streamed(_prefill_item("r", prompt, **opts), Wire(b, "r")),
                        granted.append, granted.append)
    a.release("r")
    b.release("r")
    assert not b.kv.queued and not a.kv.offered and not a.has_work()
    _run(b)  # "busy"'s pages free: no offer is left to take them
    b.expire_kv(time.monotonic() + 3600)  # nor to withdraw
    assert not granted and not b.kv.reserved and b.stats()["kv_pages_used"] == 0
    assert a.stats()["kv_pages_used"] == 0 and not a.step()


def test_later_offers_do_not_overtake_a_queued_one(model):
    prompt, small = prompts(8)[-1], prompts(8, seed=2)[-2]  # 8 pages, then 6
    a, b = make_engine(model), make_engine(model, pages=6 + 7)
    b.submit(replace(_prefill_item("busy", prompts(8)[-2], max_tokens=3), loop=LoopSpec(3)))
    b.step()
    order: list[str] = []
    for rid, p in (("r1", prompt), ("r2", small)):  # r2 would fit the 7 free pages now
        offer = a.submit_streamed(_prefill_item(rid, p), Wire(b, rid))
        assert b.reserve_kv(rid, "main", offer, lambda skip, rid=rid: order.append(rid), _kept)
    assert not order
    _run(b)
    assert order == ["r1"] and list(b.kv.queued) == [("r2", "main")]  # 13 pages: 8 for r1, 5 left
    b.release("r1")
    assert order == ["r1", "r2"] and not b.kv.queued


def test_a_queued_offer_past_its_deadline_is_withdrawn_and_those_behind_it_may_be_granted(model):
    prompt, small = prompts(8)[-1], prompts(8, seed=2)[-2]  # 8 pages, then 6
    a, b = make_engine(model), make_engine(model, pages=6 + 7, kv_offer_timeout_s=5.0)
    b.submit(replace(_prefill_item("busy", prompts(8)[-2], max_tokens=3), loop=LoopSpec(3)))
    b.step()  # "busy" holds 6 pages: r1 waits, r2 (which would fit) waits behind it
    answers: list[tuple[str, object]] = []
    for rid, p in (("r1", prompt), ("r2", small)):
        offer = a.submit_streamed(_prefill_item(rid, p), Wire(b, rid))
        assert b.reserve_kv(rid, "main", offer, lambda skip, rid=rid: answers.append((rid, skip)),
                            lambda why, rid=rid: answers.append((rid, why)))
        time.sleep(0.01)  # r2's deadline comes strictly later than r1's
    first_deadline = b.kv.queued[("r1", "main")].deadline
    b.expire_kv(first_deadline - 0.001)
    assert not answers and len(b.kv.queued) == 2
    b.expire_kv(first_deadline)
    assert answers == [("r1", "KV pages the decode worker's pool did not free within 5 s "
                               "(engines.<component>.kv_offer_timeout_s)"), ("r2", 0)]
    assert not b.kv.queued and list(b.kv.reserved) == [("r2", "main")] and b.stats()["kv_pages_used"] == 6 + 6
    b.release("r2")
    _run(b)
    assert b.stats()["kv_pages_used"] == 0 and not b.kv.reserved


def test_an_offer_larger_than_the_whole_pool_is_declined_and_recomputed(model):
    prompt = prompts(8)[-1]  # 8 pages of 4
    opts = {"temperature": 0.0, "ignore_eos": True}
    a, b = make_engine(model), make_engine(model, pages=7)
    wire, skip, first = _stream(a, b, "r", prompt, **opts)
    assert skip is None and wire.tokens_sent == 0 and wire.done is None and not b.kv.queued  # nothing streamed
    # a forgets the sequence once its item is answered: it continues on b, recomputed, not here
    assert a.stats()["kv_pages_sent"] == 0 and a.stats()["kv_pages_used"] == 0 and not a.has_work()
    assert a.stats()["seqs_running"] == 0 and not a.kv.unstreamed
    # b's recompute of a prompt its pool cannot hold fails the request with b's length limit
    b.submit_with_kv(_decode_item("r", prompt, first, 4, **opts), None)
    (result,) = b.step()
    assert "max_model_len=28" in result.error and b.stats()["kv_pages_used"] == 0


def test_a_declined_sequence_recomputes_with_the_same_tokens(model):
    prompt = prompts(8)[-1]
    want = _one_engine(model, prompt, 4, temperature=0.0, ignore_eos=True)
    a, b = make_engine(model), make_engine(model)
    wire = Wire(b, "r")
    a.submit_streamed(_prefill_item("r", prompt, temperature=0.0, ignore_eos=True), wire)
    a.stream_kv("r", "main", None)  # as when b declined
    (result,) = a.step()
    first = int(result.outputs["token"])
    b.submit_with_kv(_decode_item("r", prompt, first, 4, temperature=0.0, ignore_eos=True), None)
    assert [first, *_run(b)] == want
    assert b.stats()["prompt_tokens"] == len(prompt) and b.stats()["kv_pages_received"] == 0
    b.release("r")
    assert a.stats()["kv_pages_used"] == 0 and b.stats()["kv_pages_used"] == 0


def test_a_stream_the_receiver_dropped_fails_when_its_tokens_alone_cannot_recompute_it(model):
    prompt = prompts(8)[-1]
    b = make_engine(model)
    assert _reserve(b, "r", KVOffer(prompt, [])) == 0  # 8 pages
    # an engine loop's tokens beyond the offer that found no page: b dropped the reservation (kv_transfer.place)
    done = KVStreamEnd(prompt + [1, 2, 3], [], KVPositions(33, 5.0, True, False, num_shareable=4))
    b.submit_with_kv(_decode_item("r", prompt, 7, 4), done)
    (result,) = b.step()
    assert "explicit positions cannot be recomputed there; raise the decode worker's KV pool" in result.error
    assert b.stats()["kv_pages_used"] == 0 and not b.kv.reserved and not b.has_work()


def test_release_mid_stream_frees_every_page_on_both_engines(model):
    prompt = prompts(8)[-1]
    a, b = make_engine(model, max_batch_tokens=8), make_engine(model)
    wire = Wire(b, "r")
    offer = a.submit_streamed(_prefill_item("r", prompt, temperature=0.0), wire)
    a.stream_kv("r", "main", _reserve(b, "r", offer))
    a.step()  # the first 8 tokens computed and sent
    assert wire.tokens_sent == 8 and wire.done is None and b.stats()["kv_pages_used"] == 8
    a.release("r")
    b.release("r")
    assert not a.has_work() and not a.step()
    b.place_kv("r", "main", 0, 8, *torch.zeros(2, 8, 2, 8, dtype=torch.float64))  # late layer: ignored
    assert a.stats()["kv_pages_used"] == 0 and b.stats()["kv_pages_used"] == 0


def test_warm_up_prompts_are_not_counted(model):
    engine = make_engine(model, warm_up=True)  # as on CUDA: throwaway prompts run before serving
    assert engine.stats()["prompt_tokens"] == 0


@pytest.mark.parametrize("lookahead", [True, False])  # False: every loop step's forward is tapped
def test_an_engine_loop_streams_the_tokens_its_lookahead_steps_computed(model, lookahead):
    prompt = prompts(8)[-1]
    want = _one_engine(model, prompt, 8, temperature=0.0, ignore_eos=True)
    a, b = make_engine(model, lookahead=lookahead), make_engine(model)  # decode forwards launched ahead, untapped
    wire = Wire(b, "r")
    loop = replace(_prefill_item("r", prompt, temperature=0.0, ignore_eos=True), loop=LoopSpec(4))
    a.stream_kv("r", "main", _reserve(b, "r", a.submit_streamed(loop, wire)))
    first = _run(a)
    assert len(first) == 4 and (a.lookahead_steps > 0) == lookahead and wire.done is not None
    assert wire.done.tokens == prompt + first[:3]  # the last sample is not fed back
    b.submit_with_kv(_decode_item("r", prompt, first[3], 5, temperature=0.0, ignore_eos=True), wire.done)
    assert [*first, *_run(b)] == want
    assert wire.tokens_sent == len(prompt) + 3 and b.stats()["prompt_tokens"] == 0
    assert b.stats()["kv_pages_received"] == 9  # 33 tokens: the offer's 8 pages and one more


@pytest.mark.parametrize("pages", [64, 20])  # 20: the receiver preempts adopted sequences while they decode
def test_several_streams_at_once_sharing_a_prefix_the_receiver_caches(model, pages):
    base = prompts(8)[-1]
    p1, p2, p3 = base, base[:20] + prompts(8, seed=2)[-1][:10], prompts(8, seed=3)[-2]
    opts = {"temperature": 0.0, "ignore_eos": True}
    want = {rid: _one_engine(model, p, 8, **opts) for rid, p in (("r1", p1), ("r2", p2), ("r3", p3))}
    a, b = make_engine(model, max_batch_tokens=8), make_engine(model, pages=pages)
    wire, _, first = _stream(a, b, "r0", p1, **opts)  # b's prefix cache then holds p1's 7 full pages
    b.submit_with_kv(_decode_item("r0", p1, first, 1, **opts), wire.done)
    _run(b)
    b.release("r0")
    wires, skips = {}, {}
    for rid, p in (("r1", p1), ("r2", p2), ("r3", p3)):  # offered together: their 8-token chunks interleave
        wires[rid] = Wire(b, rid)
        skips[rid] = _reserve(b, rid, a.submit_streamed(_prefill_item(rid, p, **opts), wires[rid]))
    assert skips == {"r1": 28, "r2": 20, "r3": 0}  # r2 shares p1's first 5 pages, held by r1 too
    for rid in wires:
        a.stream_kv(rid, "main", skips[rid])
    firsts = {}
    while a.has_work():
        for r in a.step():
            firsts[r.request_id] = int(r.outputs["token"])
    assert a.stats()["kv_pages_used"] == 0
    for rid, p in (("r1", p1), ("r2", p2), ("r3", p3)):
        b.submit_with_kv(_decode_item(rid, p, firsts[rid], 8, **opts), wires[rid].done)
    got = {rid: [firsts[rid]] for rid in firsts}
    while b.has_work():
        for r in b.step():
            got[r.request_id].append(int(r.outputs["token"]))
    assert got == want
    assert (b.stats()["preemptions"] > 0) == (pages == 20)
    for rid in got:
        b.release(rid)
    assert b.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("busy_steps", [0, 6])  # the seat's holder idle, or decoding 6 more tokens
def test_a_receiver_without_a_free_seat_seats_the_sequence_with_its_pages_once_one_is(model, busy_steps, lookahead):
    prompt, other = prompts(8)[-1], prompts(8)[-2]
    opts = {"temperature": 0.0, "ignore_eos": True}
    want = _one_engine(model, prompt, 4, **opts)
    a, b = make_engine(model), make_engine(model, max_num_seqs=1, lookahead=lookahead)
    b.submit(_prefill_item("busy", other, **opts))
    (token,) = b.step()  # "busy" holds b's one seat when the streamed sequence's first item comes
    if busy_steps:
        b.submit(_decode_item("busy", other, int(token.outputs["token"]), busy_steps, **opts))
    wire, skip, first = _stream(a, b, "r", prompt, **opts)
    assert skip == 0 and wire.done is not None
    b.submit_with_kv(_decode_item("r", prompt, first, 4, **opts), wire.done)
    got = {"busy": [], "r": [first]}
    while b.has_work():
        for r in b.step():
            got[r.request_id].append(int(r.outputs["token"]))
    assert got["r"] == want and len(got["busy"]) == busy_steps
    # the prompt's K/V were not thrown away: b computed only "busy"'s prompt; "busy", idle, gave its seat up
    assert b.stats()["prompt_tokens"] == len(other) and b.stats()["preemptions"] == 1
    assert b.stats()["kv_pages_received"] == 8 and not b.kv.reserved and not b.kv.seating
    for rid in ("busy", "r"):
        b.release(rid)
    assert b.stats()["kv_pages_used"] == 0


def test_a_sequence_waiting_for_a_seat_is_released_with_its_pages(model):
    prompt, other = prompts(8)[-1], prompts(8)[-2]
    opts = {"temperature": 0.0, "ignore_eos": True}
    a, b = make_engine(model), make_engine(model, max_num_seqs=1)
    b.submit(_prefill_item("busy", other, **opts))
    (token,) = b.step()
    b.submit(_decode_item("busy", other, int(token.outputs["token"]), 6, **opts))
    wire, _, first = _stream(a, b, "r", prompt, **opts)
    b.submit_with_kv(_decode_item("r", prompt, first, 4, **opts), wire.done)
    assert b.kv.seating and b.stats()["kv_pages_used"] == 8 + 6
    b.release("r")
    assert not b.kv.seating and not b.kv.reserved and b.stats()["kv_pages_used"] == 6
    assert len(_run(b)) == 6
    b.release("busy")
    assert b.stats()["kv_pages_used"] == 0


def test_a_streamed_sequence_preempted_mid_prefill_sends_each_token_once(model):
    prompt, other = prompts(8)[-1], prompts(8)[-2]
    opts = {"temperature": 0.0, "ignore_eos": True}
    want = _one_engine(model, prompt, 4, **opts)
    a, b = make_engine(model, pages=13, max_batch_tokens=8), make_engine(model)
    a.submit(replace(_prefill_item("old", other, **opts), loop=LoopSpec(30)))  # grows to 13 pages as it decodes
    a.step()
    wire = Wire(b, "r")
    a.stream_kv("r", "main", _reserve(b, "r", a.submit_streamed(_prefill_item("r", prompt, **opts), wire)))
    firsts = {}
    while a.has_work():
        for r in a.step():
            firsts[r.request_id] = int(r.outputs["token"])
    assert a.stats()["preemptions"] > 0 and wire.tokens_sent == len(prompt) and wire.done is not None
    b.submit_with_kv(_decode_item("r", prompt, firsts["r"], 4, **opts), wire.done)
    assert [firsts["r"], *_run(b)] == want and b.stats()["prompt_tokens"] == 0


def test_tokens_the_sender_caches_but_the_receiver_lacks_travel_from_the_senders_cache(model):
    prompt = prompts(8)[-1]
    opts = {"temperature": 0.0, "ignore_eos": True}
    want = _one_engine(model, prompt, 4, **opts)
    a = make_engine(model)
    _stream(a, make_engine(model), "r0", prompt, **opts)  # a's prefix cache now holds the prompt's 7 full pages
    b = make_engine(model)
    wire, skip, first = _stream(a, b, "r", prompt, **opts)
    assert skip == 0 and wire.tokens_sent == len(prompt) and a.stats()["prompt_tokens"] == len(prompt) + 2
    b.submit_with_kv(_decode_item("r", prompt, first, 4, **opts), wire.done)
    assert [first, *_run(b)] == want and b.stats()["prompt_tokens"] == 0
