"""Two workers' `KVMoves` (worker/kv_moves.py) over a hand-delivered message queue, each with a tiny
autoregressive engine: a request released at any point of its K/V stream (before the receiver's answer,
between the answer and the first layer, after KVEnd but before the decode item) leaves no page and no
move state on either side; an offer the receiver has no room for is answered once another request's pages
free, or leaves nothing when released while it waits, or, still queued at the receiver's `kv_offer_timeout_s`, is
declined with that reason and recomputed there; a receiver that is gone fails only the streamed request, not the
sender's other work, and an offer it cannot be sent waits for the release; a target naming the worker itself
streams nothing."""

from __future__ import annotations

import time

import pytest
import torch

from mstar.engines.base import LoopSpec, StepItem
from mstar.runtime.codecs import LocalCodec
from mstar.transport import PeerUnavailable
from mstar.worker.kv_moves import KVMoves
from tests.unit.test_ar_engine import TinyLM, make_engine, prompts

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model():
    return TinyLM()


class Net:
    """Messages between ranks, delivered when the test says; `gone` ranks refuse what is sent to them."""

    def __init__(self) -> None:
        self.queue: list[tuple[int, object]] = []
        self.gone: set[int] = set()

    def send(self, rank: int, msg: object) -> None:
        if rank in self.gone:
            raise PeerUnavailable(f"rank {rank} is gone")
        self.queue.append((rank, msg))

    def deliver(self, moves: dict[int, KVMoves], keep=lambda msg: False) -> None:
        """Hand every queued message to its rank, except those `keep` holds back (left queued)."""
        queue, self.queue = self.queue, []
        for rank, msg in queue:
            if keep(msg):
                self.queue.append((rank, msg))
            else:
                moves[rank].handle(msg)


def _pair(model, receiver_pages=64, receiver_timeout_s=60.0, **kw):
    net = Net()
    a, b = make_engine(model, **kw), make_engine(model, pages=receiver_pages, kv_offer_timeout_s=receiver_timeout_s)
    moves = {r: KVMoves(r, {"llm": e}, net.send, LocalCodec(), lambda t: t) for r, e in ((0, a), (1, b))}
    return net, a, b, moves


def _prefill(rid: str, prompt: list[int]) -> StepItem:
    return StepItem(rid, "prefill", "llm", {"input_ids": torch.tensor(prompt)}, GREEDY)


def _decode(rid: str, prompt: list[int], first: int, steps: int) -> StepItem:
    return StepItem(rid, "decode", "llm", {"input_ids": torch.tensor([first]), "prompt_ids": torch.tensor(prompt)},
                    GREEDY, loop=LoopSpec(steps))


def _steps(engine, net=None, moves=None) -> list:
    results = []
    while engine.has_work():
        results += engine.step()
        if net is not None:
            net.deliver(moves)
    return results


def _empty(*engines_and_moves) -> bool:
    for x in engines_and_moves:
        if isinstance(x, KVMoves):
            if len(x):
                return False
        elif any(x.stats()[k] for k in ("kv_pages_used", "seqs_running", "seqs_waiting", "queue_depth")) \
                or x.kv.offered or x.kv.streams or x.kv.reserved or x.kv.unstreamed:
            return False
    return True


def test_a_streamed_request_decodes_through_the_moves(model):
    prompt = prompts(8)[-1]
    want = _steps_one_engine(model, prompt, 5)
    net, a, b, moves = _pair(model, max_batch_tokens=8)
    moves[0].start("r", {"llm": 1})
    assert moves[0].submit("llm", _prefill("r", prompt))
    net.deliver(moves)  # the offer: b reserves
    net.deliver(moves)  # the accept: a streams
    (result,) = _steps(a, net, moves)
    first = int(result.outputs["token"])
    assert moves[1].submit("llm", _decode("r", prompt, first, 5))
    assert [first, *[int(r.outputs["token"]) for r in _steps(b)]] == want
    assert b.stats()["prompt_tokens"] == 0 and b.stats()["kv_pages_received"] == 8
    b.release("r")
    moves[1].release("r")
    assert _empty(a, b, *moves.values())


def _steps_one_engine(model, prompt, steps) -> list[int]:
    engine = make_engine(model)
    engine.submit(_prefill("r", prompt))
    (result,) = engine.step()
    first = int(result.outputs["token"])
    engine.submit(StepItem("r", "decode", "llm", {"input_ids": torch.tensor([first])}, GREEDY, loop=LoopSpec(steps)))
    return [first, *[int(r.outputs["token"]) for r in _steps(engine)]]


def _release(rid, engines, moves) -> None:
    for e in engines:
        e.release(rid)
    for m in moves.values():
        m.release(rid)


@pytest.mark.parametrize("when", ["before the accept", "between the accept and the first layer",
                                  "after the end, before the decode item"])
def test_a_request_released_during_its_move_leaves_nothing(model, when):
    prompt = prompts(8)[-1]
    net, a, b, moves = _pair(model)
    moves[0].start("r", {"llm": 1})
    moves[0].submit("llm", _prefill("r", prompt))
    net.deliver(moves)  # b reserved, its accept is queued
    assert b.stats()["kv_pages_used"] == 8
    if when == "before the accept":
        _release("r", (a, b), moves)
        net.deliver(moves)  # the late accept meets a released request
    elif when == "between the accept and the first layer":
        net.deliver(moves)
        assert a.has_work()
        _release("r", (a, b), moves)
    else:
        net.deliver(moves)
        _steps(a, net, moves)
        assert len(moves[1]) == 1 and _empty(a)  # b holds the end, a forgot the sequence
        _release("r", (a, b), moves)
    assert not _steps(a, net, moves) and not net.queue
    assert _empty(a, b, *moves.values())


def test_a_receiver_gone_mid_stream_fails_only_the_streamed_request(model):
    prompt = prompts(8)[-1]
    net, a, b, moves = _pair(model, max_batch_tokens=64)
    moves[0].start("r", {"llm": 1})
    moves[0].submit("llm", _prefill("r", prompt))
    net.deliver(moves)
    net.deliver(moves)  # a streams r to rank 1 ...
    net.gone.add(1)  # ... which dies before the first layer leaves
    a.submit(_prefill("other", prompts(8)[-2]))  # prefilled in the same forward as r
    results = _steps(a)
    assert sorted(r.request_id for r in results if r.error is None) == ["other", "r"]
    a.release("r")
    a.release("other")
    assert _empty(a)


def test_a_target_naming_the_worker_itself_streams_nothing(model):
    net, a, _, moves = _pair(model)
    moves[0].start("r", {"llm": 0})
    assert not moves[0].submit("llm", _prefill("r", prompts(8)[-1])) and not net.queue and not len(moves[0])


@pytest.mark.parametrize("then", ["the other request ends", "released while queued"])
def test_an_offer_without_room_is_answered_once_pages_free(model, then):
    prompt, other = prompts(8)[-1], prompts(8)[-2]
    net, a, b, moves = _pair(model, receiver_pages=6 + 7)  # "busy" holds 6 of b's pages, r needs 8
    b.submit(StepItem("busy", "prefill", "llm", {"input_ids": torch.tensor(other)}, {**GREEDY, "max_tokens": 3},
                      loop=LoopSpec(3)))
    b.step()
    moves[0].start("r", {"llm": 1})
    moves[0].submit("llm", _prefill("r", prompt))
    net.deliver(moves)  # the offer: b queues it and answers nothing yet
    assert not net.queue and b.kv.queued and not a.has_work()
    if then == "released while queued":
        _release("r", (a, b), moves)
    _steps(b)  # "busy" ends and frees its pages
    if then == "released while queued":
        assert not net.queue and _empty(a, b, *moves.values())
        return
    (_, accept), = net.queue
    assert accept.skip == 0 and len(moves[1]) == 1
    net.deliver(moves)  # the accept: a streams
    (result,) = _steps(a, net, moves)
    first = int(result.outputs["token"])
    assert moves[1].submit("llm", _decode("r", prompt, first, 5))
    assert [first, *[int(r.outputs["token"]) for r in _steps(b)]] == _steps_one_engine(model, prompt, 5)
    assert b.stats()["prompt_tokens"] == len(other) and b.stats()["kv_pages_received"] == 8
    _release("r", (a, b), moves)
    assert _empty(a, b, *moves.values())


def test_an_offer_larger_than_the_receivers_pool_is_declined(model):
    net, a, b, moves = _pair(model, receiver_pages=7)
    moves[0].start("r", {"llm": 1})
    moves[0].submit("llm", _prefill("r", prompts(8)[-1]))  # 8 pages
    net.deliver(moves)
    (_, answer), = net.queue
    assert answer.skip < 0 and not len(moves[1]) and not b.kv.queued
    net.deliver(moves)
    assert len(_steps(a)) == 1 and _empty(a, b)  # a computes the item and forgets the sequence


def test_an_offer_still_queued_at_its_deadline_is_declined_and_recomputed(model):
    prompt, other = prompts(8)[-1], prompts(8)[-2]
    net, a, b, moves = _pair(model, receiver_pages=6 + 7, receiver_timeout_s=30.0)  # "busy" holds 6, r needs 8
    b.submit(StepItem("busy", "prefill", "llm", {"input_ids": torch.tensor(other)}, {**GREEDY, "max_tokens": 3},
                      loop=LoopSpec(3)))
    b.step()
    moves[0].start("r", {"llm": 1})
    moves[0].submit("llm", _prefill("r", prompt))
    net.deliver(moves)  # the offer: b queues it
    moves[1].expire_offers(time.monotonic())  # within its deadline: it waits on
    assert not net.queue and b.kv.queued and len(moves[1]) == 1 and not a.has_work()
    moves[1].expire_offers(time.monotonic() + 30.0)
    (_, answer), = net.queue
    assert answer.skip < 0 and "within 30 s (engines.<component>.kv_offer_timeout_s)" in answer.declined
    assert not b.kv.queued and not b.kv.reserved and not len(moves[1]) and b.stats()["kv_pages_used"] == 6
    net.deliver(moves)  # the decline: a computes the sequence without streaming it and forgets it
    (result,) = _steps(a, net, moves)
    assert result.error is None and not net.queue and _empty(a)
    first = int(result.outputs["token"])
    assert not moves[1].submit("llm", _decode("r", prompt, first, 5))  # nothing comes: b recomputes it
    b.submit(_decode("r", prompt, first, 5))
    got = [int(r.outputs["token"]) for r in _steps(b) if r.request_id == "r"]
    assert [first, *got] == _steps_one_engine(model, prompt, 5)
    assert b.stats()["prompt_tokens"] == len(other) + len(prompt) and b.stats()["kv_pages_received"] == 0
    _release("r", (a, b), moves)
    b.release("busy")
    assert _empty(a, b, *moves.values())


def test_an_offer_the_receiver_cannot_be_sent_waits_for_the_release(model):
    net, a, b, moves = _pair(model)
    net.gone.add(1)
    moves[0].start("r", {"llm": 1})
    assert moves[0].submit("llm", _prefill("r", prompts(8)[-1]))  # the send fails: logged, not raised
    assert not net.queue and not a.has_work() and a.kv.offered  # it waits for the conductor's release
    _release("r", (a, b), moves)
    assert _empty(a, b, *moves.values())
