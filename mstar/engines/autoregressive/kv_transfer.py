"""Moving a sequence between engines while it is computed (`KVHandoff`): the sender offers it before its
forward runs, the receiver takes pages for it (the leading ones its prefix cache holds, free ones for the
rest), and each layer's K/V of the sequence's tokens leaves the sender as soon as its forward wrote that
layer, to be written into the receiver's pages; the receiver's first item then starts from them.

Every paged backend (SDPA, Triton, FlashInfer) keeps one K and one V tensor of shape
[layers, pages, page_size, kv_heads, head_dim] indexed by page id (`PagedKVCache`); K/V travel by token
position ([tokens, kv_heads, head_dim] per layer), so the two ends' page ids need not match.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from mstar.engines.base import StepResult
from mstar.engines.cuda_graphs import to_device_async
from mstar.engines.kv_cache.prefix_cache import hash_pages
from mstar.engines.kv_handoff import KVGranted, KVOffer, KVStreamEnd, KVStreamSink, KVWithdrawn

if TYPE_CHECKING:
    from mstar.engines.autoregressive.batch_scheduler import BatchScheduler, Chunk
    from mstar.engines.autoregressive.sequence import Sequence
    from mstar.engines.kv_cache.block_pool import BlockPool


@runtime_checkable
class PagedKVCache(Protocol):
    """A backend whose cache is two [layers, pages, page_size, kv_heads, head_dim] tensors."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor


def _cache(attn: object) -> PagedKVCache:
    if not isinstance(attn, PagedKVCache):
        raise TypeError(f"{type(attn).__name__} keeps no paged k_cache/v_cache: its sequences cannot move")
    return attn


def token_slots(attn: object, pages: list[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """Flat cache slots of token positions [start, end) of a sequence holding `pages`, on the cache's device
    (copied without waiting for the work queued there)."""
    slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(start, end)],
                         dtype=torch.long)
    return to_device_async(slots, _cache(attn).k_cache.device)


def gather_slots(attn: object, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the K and V of `layer` at cache `slots`, [len(slots), kv_heads, head_dim] each."""
    cache = _cache(attn)
    shape = (-1, *cache.k_cache.shape[3:])
    return cache.k_cache[layer].view(shape)[slots], cache.v_cache[layer].view(shape)[slots]


def place_tokens(attn: object, pages: list[int], page_size: int, layer: int, start: int, k: torch.Tensor,
                 v: torch.Tensor, slots: torch.Tensor | None = None) -> None:
    """Write K and V of `layer` for token positions [start, start + len(k)) into `pages` (at `slots`, those
    positions' `token_slots`, when the caller has them)."""
    cache = _cache(attn)
    end = start + k.shape[0]
    if layer >= cache.k_cache.shape[0] or end > len(pages) * page_size or k.shape[1:] != cache.k_cache.shape[3:]:
        raise ValueError(f"K/V of layer {layer}, tokens [{start}, {end}), shape {tuple(k.shape)} do not fit "
                         f"{len(pages)} pages of a cache shaped {tuple(cache.k_cache.shape)}")
    if slots is None:
        slots = token_slots(attn, pages, page_size, start, end)
    shape = (-1, *cache.k_cache.shape[3:])
    with torch.inference_mode():
        cache.k_cache[layer].view(shape)[slots] = k.to(cache.k_cache.device, cache.k_cache.dtype)
        cache.v_cache[layer].view(shape)[slots] = v.to(cache.v_cache.device, cache.v_cache.dtype)


@dataclass
class _Stream:
    """A sequence whose K/V leave as computed: where to, and the tokens before `sent` that already went."""

    sink: KVStreamSink
    sent: int
    skip: int  # leading tokens the receiver held


@dataclass
class _Queued:
    """An offer waiting for pages: whom to answer, and until when it may wait."""

    offer: KVOffer
    granted: KVGranted
    withdrawn: KVWithdrawn
    deadline: float  # time.monotonic() after which it is withdrawn


@dataclass
class _Reserved:
    """Pages taken for a sequence streamed here; the first `held` came from the prefix cache."""

    pages: list[int]
    held: int
    slots: tuple[int, int, torch.Tensor] | None = None  # the last token range placed and its cache slots


class KVStreams:
    """An engine's sequences on the move: offered ones waiting for the receiver's answer, streamed ones
    (sender), offers waiting for pages, reserved ones and adopted ones waiting for a seat (receiver). The
    engine calls it; it owns no sequence (those waiting for a seat are the engine's, held here until seated)."""

    def __init__(self, pool: BlockPool, attn: object, offer_timeout_s: float) -> None:
        """`offer_timeout_s`: how long an offer may wait for pages (`AutoregressiveSpec.kv_offer_timeout_s`)."""
        self.pool, self.attn, self.offer_timeout_s = pool, attn, offer_timeout_s
        self.offered: dict[tuple[str, str], KVStreamSink] = {}
        self.streams: dict[tuple[str, str], _Stream] = {}
        self.unstreamed: set[tuple[str, str]] = set()  # continued elsewhere by recomputing: nothing streams
        self.queued: dict[tuple[str, str], _Queued] = {}  # offers waiting for pages, in arrival (and deadline) order
        self.reserved: dict[tuple[str, str], _Reserved] = {}
        self.seating: dict[tuple[str, str], tuple[Sequence, KVStreamEnd]] = {}  # adopted, no seat free yet
        self.pages_sent = self.pages_received = self.pages_reused = 0

    def offer(self, seq: Sequence, sink: KVStreamSink) -> KVOffer:
        """Hold `seq` (new, not yet scheduled) for `start`; what the receiver needs to know of it."""
        self.offered[seq.key] = sink
        page = self.pool.page_size
        shareable = seq.num_shareable // page * page
        return KVOffer(list(seq.token_ids), hash_pages(seq.token_ids[:shareable], page, []))

    def start(self, key: tuple[str, str], skip: int | None) -> bool:
        """Stream the offered sequence from token `skip` on (None: not at all, the receiver recomputes it);
        False when none is offered."""
        sink = self.offered.pop(key, None)
        if sink is None:
            return False
        if skip is None:
            self.unstreamed.add(key)
        else:
            self.streams[key] = _Stream(sink, skip, skip)
        return True

    def layer_tap(self, chunks: list[Chunk]) -> Callable[[int], None] | None:
        """What the forward of `chunks` calls once a layer's K/V are in the cache: that layer of the streamed
        sequences' tokens not sent yet goes to their sinks (None: no streamed sequence in `chunks`)."""
        page, sends = self.pool.page_size, []
        for c in chunks:
            s = self.streams.get(c.seq.key)
            end = c.start + c.num_tokens
            if s is not None and end > s.sent:  # a recomputed chunk (after preemption) went already
                sends.append((s, token_slots(self.attn, c.seq.pages, page, s.sent, end)))
        if not sends:
            return None

        def layer_done(layer: int) -> None:
            for s, slots in sends:
                s.sink.layer(layer, s.sent, *gather_slots(self.attn, layer, slots))
        return layer_done

    def computed(self, chunks: list[Chunk]) -> None:
        """The forward of `chunks` ran: their streamed tokens went."""
        for c in chunks:
            s = self.streams.get(c.seq.key)
            if s is not None:
                s.sent = max(s.sent, c.start + c.num_tokens)

    def finish(self, seq: Sequence) -> bool:
        """End the stream of `seq` (its item is answered: every token computed); False when it was not
        offered (it stays here). Tokens computed by forwards that ran untapped (an engine loop's lookahead)
        go now, every layer. True also for a sequence the receiver declined: it continues there, recomputed."""
        s = self.streams.pop(seq.key, None)
        if s is None:
            if seq.key not in self.unstreamed:
                return False
            self.unstreamed.discard(seq.key)
            return True
        page = self.pool.page_size
        if seq.num_computed > s.sent:
            slots = token_slots(self.attn, seq.pages, page, s.sent, seq.num_computed)
            for layer in range(_cache(self.attn).k_cache.shape[0]):
                s.sink.layer(layer, s.sent, *gather_slots(self.attn, layer, slots))
        self.pages_sent += self.pool.pages_for(len(seq.token_ids)) - s.skip // page
        positions = seq.inputs.continuation() if seq.inputs is not None else None
        s.sink.end(KVStreamEnd(list(seq.token_ids), list(seq.page_hashes[: seq.num_registered]), positions))
        return True

    def reserve(self, key: tuple[str, str], offer: KVOffer, granted: KVGranted, withdrawn: KVWithdrawn) -> bool:
        """`KVHandoff.reserve_kv`: the offer queues behind earlier ones until the pool has room for it, or
        until `offer_timeout_s` passed (`expire`)."""
        if key in self.reserved or key in self.queued or self.pool.pages_for(len(offer.tokens)) > self.pool.num_pages:
            return False
        self.queued[key] = _Queued(offer, granted, withdrawn, time.monotonic() + self.offer_timeout_s)
        self.grant()
        return True

    def expire(self, now: float) -> None:
        """`KVHandoff.expire_kv`: deadlines grow in queue order, so the late offers lead the queue."""
        withdrew = False
        while self.queued:
            key, q = next(iter(self.queued.items()))
            if q.deadline > now:
                break
            del self.queued[key]
            withdrew = True
            q.withdrawn(f"KV pages the decode worker's pool did not free within {self.offer_timeout_s:g} s "
                        "(engines.<component>.kv_offer_timeout_s)")
        if withdrew:  # an offer behind the withdrawn ones may fit what is free
            self.grant()

    def grant(self) -> None:
        """Take pages for the queued offers, first come first, while the pool has room for the next one."""
        while self.queued:
            key, q = next(iter(self.queued.items()))
            held = self.pool.match_prefix(q.offer.page_hashes)
            fresh = self.pool.pages_for(len(q.offer.tokens)) - len(held)
            if fresh > self.pool.num_free:
                self.pool.free(held)
                return
            del self.queued[key]
            self.reserved[key] = _Reserved([*held, *self.pool.allocate(fresh)], len(held))
            q.granted(len(held) * self.pool.page_size)

    def place(self, key: tuple[str, str], layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """`KVHandoff.place_kv`."""
        r = self.reserved.get(key)
        if r is None:
            return
        grow = self.pool.pages_for(start + k.shape[0]) - len(r.pages)  # tokens an engine loop appended
        if grow > self.pool.num_free:  # no room after all: the sequence recomputes (or fails, if its ids cannot)
            self.release_reserved(key)
            return
        if grow > 0:
            r.pages += self.pool.allocate(grow)
        end = start + k.shape[0]
        if r.slots is None or r.slots[:2] != (start, end):  # every layer of one chunk lands at the same slots
            r.slots = (start, end, token_slots(self.attn, r.pages, self.pool.page_size, start, end))
        place_tokens(self.attn, r.pages, self.pool.page_size, layer, start, k, v, r.slots[2])

    def adopt(self, seq: Sequence, done: KVStreamEnd, sched: BatchScheduler) -> bool:
        """Give a new sequence (not yet queued) of `done.tokens` its reserved pages: it joins `sched`'s
        running sequences with its tokens computed, now or, holding its pages, once a seat is free (`seat`).
        False when it cannot (no reservation, a sequence of other length than offered): its reservation is
        freed and it recomputes."""
        r = self.reserved.get(seq.key)
        if r is None:
            return False
        if len(r.pages) != self.pool.pages_for(len(done.tokens)):
            self.release_reserved(seq.key)
            return False
        self.seating[seq.key] = (seq, done)
        self.seat(sched)
        return True

    def seat(self, sched: BatchScheduler) -> None:
        """Seat the adopted sequences waiting for a seat, first come first, while `sched` has seats."""
        while self.seating and sched.free_seat():
            key = next(iter(self.seating))
            seq, done = self.seating.pop(key)
            r = self.reserved.pop(key)
            seq.pages, seq.num_computed = r.pages, len(done.tokens)
            seq.page_hashes = list(done.page_hashes)
            for i in range(r.held, len(done.page_hashes)):
                self.pool.register(seq.pages[i], done.page_hashes[i])
            seq.num_registered = len(done.page_hashes)
            sched.adopt(seq)
            self.pages_received += len(r.pages) - r.held
            self.pages_reused += r.held

    def release_reserved(self, key: tuple[str, str]) -> None:
        """Give back the pages reserved for `key` that no sequence adopted."""
        if key in self.seating:
            return
        r = self.reserved.pop(key, None)
        if r is not None:
            self.pool.free(r.pages)
            self.grant()

    def release(self, request_id: str) -> None:
        """Forget the request's sequences on the move; its reserved pages go back to the pool."""
        for table in (self.offered, self.streams, self.queued):
            for key in [k for k in table if k[0] == request_id]:
                del table[key]
        self.unstreamed = {k for k in self.unstreamed if k[0] != request_id}
        for key in [k for k in self.seating if k[0] == request_id]:
            del self.seating[key]
        for key in [k for k in self.reserved if k[0] == request_id]:
            self.pool.free(self.reserved.pop(key).pages)
        self.grant()


PREEMPTED = "to give its KV pages up to other sequences (preemption)"  # why a moved sequence was dropped


def not_recomputable(request_id: str, num_tokens: int, cause: str) -> str:
    """The error of a moved sequence the decode worker would have to recompute from its token ids alone."""
    return (f"request {request_id!r}: its {num_tokens}-token sequence needs {cause}, and its media rows or explicit "
            "positions cannot be recomputed there; raise the decode worker's KV pool (engines.<component>."
            "max_num_pages or memory_fraction, or kv_cache.max_num_pages)")


def fail_dropped(sched: BatchScheduler, seqs: dict[tuple[str, str], Sequence]) -> list[StepResult]:
    """Forget the sequences `sched` dropped instead of preempting (moved here, they cannot recompute):
    the error of each pending item, an idle sequence's next item failing with it (`Sequence.error`)."""
    results = []
    for seq in sched.dropped:
        if seqs.get(seq.key) is not seq:  # released meanwhile
            continue
        seq.error = not_recomputable(seq.key[0], len(seq.token_ids), PREEMPTED)
        if (item := seq.item) is not None:
            del seqs[seq.key]
            results.append(StepResult(item.request_id, item.walk, item.node, error=seq.error, iteration=item.iteration))
    sched.dropped.clear()
    return results
