"""Moving a sequence's KV pages between workers while it is computed (prefill/decode disaggregation).

The conductor names, in `StartWalk.kv_targets`, the rank that continues a component's sequence in the
request's next walk. Here, the component's first item of that sequence is submitted waiting (`KVOffer` to
that rank); once the receiver answers (`KVAccept`: it took pages, holding what its prefix cache had, at
once or, its offer queued behind earlier ones, when enough pages freed), the sequence runs, and every
layer's K/V leaves as the forward writes it (`KVLayer`), then `KVEnd`. On the receiver each layer is placed
at once; the sequence's first item there waits for `KVEnd` (`KVHandoff` in engines/kv_handoff.py). An offer
the receiver cannot seat (larger than its pool, or still queued at its engine's `kv_offer_timeout_s`:
`expire_offers`, each pass of the worker's loop) is declined (`KVAccept` skip < 0 and why): the sender
computes the sequence without streaming it and the receiver recomputes it, or, when its token ids alone
cannot recompute it, the sender fails its request with that reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from mstar.engines.base import Engine, StepItem
from mstar.engines.kv_handoff import WHOLE_POOL, KVHandoff, KVOffer, KVPositions, KVStreamEnd
from mstar.transport import PeerUnavailable, wire
from mstar.transport.messages import discard_message

logger = logging.getLogger(__name__)

_Key = tuple[str, str, str]  # (rid, component, kv_slot)
_LAYERS_COMING = None  # an accepted stream whose KVEnd has not come


def _hash_bytes(hashes: list[int]) -> list[bytes]:
    """128-bit page hashes as msgpack carries them (its ints stop at 64 bits)."""
    return [h.to_bytes(16, "little") for h in hashes]


def _hash_ints(hashes: list[bytes]) -> list[int]:
    return [int.from_bytes(h, "little") for h in hashes]


class KVMoves:
    """A worker's side of moving sequences: where its sequences stream to, and the streams coming in."""

    def __init__(self, rank: int, engines: dict[str, Engine], send: Callable[[int, Any], None], codec,
                 to_device: Callable[[Any], Any]) -> None:
        """`send(rank, msg)` sends to another worker at once; `codec` packs tensors for the wire."""
        self.rank, self.engines, self.send, self.codec, self.to_device = rank, engines, send, codec, to_device
        self._targets: dict[tuple[str, str], int] = {}  # (rid, component) -> rank its sequence streams to
        self._incoming: dict[_Key, KVStreamEnd | None] = {}  # accepted streams -> their end, once it came
        self._queued: set[_Key] = set()  # offers the engine queued for pages, not answered yet
        self._waiting: dict[_Key, StepItem] = {}  # first items held until their stream's end

    def start(self, rid: str, kv_targets: dict[str, int]) -> None:
        """Note the ranks a walk's components (`StartWalk.kv_targets`) stream their sequences to (a walk's
        driver is told them all: the rank that continues a sequence never streams it to itself)."""
        for component, rank in kv_targets.items():
            if rank != self.rank and isinstance(self.engines.get(component), KVHandoff):
                self._targets[(rid, component)] = rank

    def submit(self, component: str, item: StepItem) -> bool:
        """Submit `item` if a move concerns it (it starts a sequence streamed from or to here); False:
        submit it as usual."""
        if not self._targets and not self._incoming:
            return False
        key = (item.request_id, component, item.kv_slot)
        engine = self.engines[component]
        if key in self._incoming:
            assert isinstance(engine, KVHandoff)  # only such engines accept offers (_offer)
            done = self._incoming[key]
            if done is _LAYERS_COMING:
                self._waiting[key] = item
            else:
                del self._incoming[key]
                engine.submit_with_kv(item, done)
            return True
        target = self._targets.pop((item.request_id, component), None)
        if target is None:
            return False
        assert isinstance(engine, KVHandoff)  # only such engines get a target (start)
        offer = engine.submit_streamed(item, _Sink(self, key, target))
        if offer is not None:
            try:
                self.send(target, wire.KVOffer(*key, offer.tokens, _hash_bytes(offer.page_hashes), self.rank))
            except PeerUnavailable:  # the sequence waits, holding no page, until the request's release
                logger.warning("rank %d is gone: request %s's K/V offer is not sent", target, key[0])
        return True

    def handle(self, msg: wire.KVOffer | wire.KVAccept | wire.KVLayer | wire.KVEnd) -> None:
        if isinstance(msg, wire.KVOffer):
            self._offer(msg)
        elif isinstance(msg, wire.KVAccept):
            engine = self.engines[msg.component]
            assert isinstance(engine, KVHandoff)
            if msg.skip < 0:
                engine.stream_kv(msg.rid, msg.kv_slot, None, msg.declined)
            else:
                engine.stream_kv(msg.rid, msg.kv_slot, msg.skip)
        elif isinstance(msg, wire.KVLayer):
            self._place(msg)
        else:
            self._end(msg)

    def expire_offers(self, now: float) -> None:
        """Decline the offers queued here past their engine's deadline at `now` (`time.monotonic()`)."""
        if not self._queued:
            return
        for component in {key[1] for key in self._queued}:
            engine = self.engines[component]
            assert isinstance(engine, KVHandoff)  # only such engines queue offers (_offer)
            engine.expire_kv(now)

    def release(self, rid: str) -> None:
        for table in (self._targets, self._incoming, self._waiting):
            for key in [k for k in table if k[0] == rid]:
                del table[key]
        self._queued = {k for k in self._queued if k[0] != rid}

    def __len__(self) -> int:
        return len(self._targets) + len(self._incoming) + len(self._waiting) + len(self._queued)

    def _offer(self, msg: wire.KVOffer) -> None:
        key = (msg.rid, msg.component, msg.kv_slot)
        engine = self.engines.get(msg.component)
        if not isinstance(engine, KVHandoff):  # the conductor names only ranks whose engine takes moved K/V
            self._answer(msg.reply_to, wire.KVAccept(*key, -1, f"an engine on rank {self.rank} that takes moved K/V"))
            return
        rank = msg.reply_to
        self._queued.add(key)  # until the engine grants or withdraws it (maybe within reserve_kv)
        if not engine.reserve_kv(msg.rid, msg.kv_slot, KVOffer(msg.tokens, _hash_ints(msg.page_hashes)),
                                 lambda skip: self._accept(key, rank, skip), lambda why: self._withdrawn(key, rank, why)):
            self._queued.discard(key)
            self._answer(rank, wire.KVAccept(*key, -1, WHOLE_POOL))

    def _accept(self, key: _Key, rank: int, skip: int) -> None:
        """The engine took pages for an offer (called from its methods, maybe long after the offer)."""
        self._queued.discard(key)
        self._incoming[key] = _LAYERS_COMING
        self._answer(rank, wire.KVAccept(*key, skip))

    def _withdrawn(self, key: _Key, rank: int, why: str) -> None:
        """The engine dropped an offer that found no pages by its deadline (`expire_kv`): declined."""
        self._queued.discard(key)
        logger.warning("request %s's K/V offer for %s found no free pages here in time: declined (%s)",
                       key[0], key[1], why)
        self._answer(rank, wire.KVAccept(*key, -1, why))

    def _answer(self, rank: int, msg: wire.KVAccept) -> None:
        try:
            self.send(rank, msg)
        except PeerUnavailable:  # the request fails once the conductor learns of it; its release frees the pages
            logger.warning("rank %d is gone: request %s's K/V offer is not answered", rank, msg.rid)

    def _place(self, msg: wire.KVLayer) -> None:
        if (msg.rid, msg.component, msg.kv_slot) not in self._incoming:  # released meanwhile
            discard_message(msg, self.codec.discard)
            return
        engine = self.engines[msg.component]
        assert isinstance(engine, KVHandoff)
        k, v = (self.to_device(self.codec.unpack(t)) for t in (msg.k, msg.v))
        engine.place_kv(msg.rid, msg.kv_slot, msg.layer, msg.start, k, v)

    def _end(self, msg: wire.KVEnd) -> None:
        key = (msg.rid, msg.component, msg.kv_slot)
        if key not in self._incoming:  # released meanwhile
            return
        p = msg.positions
        positions = None if p is None else KVPositions(p.start, p.offset, p.multi_row, p.fractional, p.num_shareable)
        done = KVStreamEnd(msg.tokens, _hash_ints(msg.page_hashes), positions)
        item = self._waiting.pop(key, None)
        if item is None:
            self._incoming[key] = done
            return
        del self._incoming[key]
        engine = self.engines[msg.component]
        assert isinstance(engine, KVHandoff)
        engine.submit_with_kv(item, done)


class _Sink:
    """The `KVStreamSink` of one sequence streamed from here: each call leaves as a message at once. A
    receiver found gone gets nothing more: the sequence's request fails when the conductor learns of the
    death, and the forward that calls this must go on for the other sequences it computes."""

    def __init__(self, moves: KVMoves, key: _Key, rank: int) -> None:
        self.moves, self.key, self.rank = moves, key, rank
        self.gone = False

    def layer(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.gone:
            pack = self.moves.codec.pack
            self._send(wire.KVLayer(*self.key, layer, start, pack(k, self.rank), pack(v, self.rank)))

    def end(self, done: KVStreamEnd) -> None:
        p = done.positions
        positions = None if p is None else wire.KVPositionsWire(p.start, p.offset, p.multi_row, p.fractional,
                                                                p.num_shareable)
        if not self.gone:
            self._send(wire.KVEnd(*self.key, done.tokens, _hash_bytes(done.page_hashes), positions))

    def _send(self, msg: wire.KVLayer | wire.KVEnd) -> None:
        try:
            self.moves.send(self.rank, msg)
        except PeerUnavailable:  # the send released the message's payloads
            logger.warning("rank %d is gone: request %s's K/V stream stops", self.rank, self.key[0])
            self.gone = True
