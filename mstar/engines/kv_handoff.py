"""The contract by which an autoregressive sequence moves between engines of one component on different
workers (prefill/decode disaggregation), layer by layer while the sender computes it: what the receiver
learns first (`KVOffer`), where the sender puts each layer's K/V as its forward writes them
(`KVStreamSink`), what closes the stream (`KVStreamEnd`, with its M-RoPE `KVPositions`) and the engine side
of the move (`KVHandoff`); engines/autoregressive/kv_transfer.py implements it for paged caches and
worker/kv_moves.py carries it between workers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from mstar.engines.base import StepItem


@dataclass
class KVPositions:
    """Where the rotary positions of a sequence's next tokens continue after explicit ones (M-RoPE):
    token i >= `start` sits at i + `offset` on every row (3 rows when `multi_row`)."""

    start: int
    offset: float
    multi_row: bool
    fractional: bool  # some explicit positions were floats (video timing)
    num_shareable: int  # leading tokens whose K/V depend on their ids alone


@dataclass
class KVOffer:
    """A sequence about to be computed and streamed: its tokens and the chained hashes of its full pages
    whose K/V depend on their tokens alone (those the receiver's prefix cache holds need not travel)."""

    tokens: list[int]
    page_hashes: list[int]


@dataclass
class KVStreamEnd:
    """A streamed sequence, computed: every token, the chained hashes of its full shareable pages, and
    where its positions continue (None: at the token indexes)."""

    tokens: list[int]
    page_hashes: list[int]
    positions: KVPositions | None = None


KVGranted = Callable[[int], None]
"""What a receiver calls once it took pages for an offer: the number of leading tokens it held."""

KVWithdrawn = Callable[[str], None]
"""What a receiver calls instead when a queued offer found no pages by its deadline: why, in words the
sender's error quotes ("...needs <why>, and ...")."""

WHOLE_POOL = "more KV pages than the decode worker's whole pool"
"""Why an offer is declined at once: it can never fit (`reserve_kv` False)."""


class KVStreamSink(Protocol):
    """Where a sender's engine puts one streamed sequence as its forwards compute it."""

    def layer(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The final K and V of tokens [start, start + len(k)) of `layer` ([tokens, kv_heads, head_dim]),
        called as soon as the forward wrote them, before it computes the next layer."""
        ...

    def end(self, done: KVStreamEnd) -> None:
        """Every layer of every token went: the sequence is complete and the sender forgot it."""
        ...


@runtime_checkable
class KVHandoff(Protocol):
    """An engine whose sequences can move to another worker's engine of the same component while they are
    computed. Sender: `submit_streamed` an item (its sequence waits), `stream_kv` once the receiver
    answered. Receiver: `reserve_kv` for the offer, `place_kv` each layer, `submit_with_kv` the first item."""

    def submit_streamed(self, item: StepItem, sink: KVStreamSink) -> KVOffer | None:
        """`submit`; when `item` starts a new sequence it waits, computing nothing, until `stream_kv`, and
        its offer is returned. None: the item was submitted as usual (or failed) and nothing streams."""
        ...

    def stream_kv(self, request_id: str, kv_slot: str, skip: int | None, declined: str = WHOLE_POOL) -> None:
        """Start the waiting sequence: the K/V of its tokens from `skip` on go to its sink as computed, and
        the sink's `end` follows its item's result; `skip` None: the receiver declined it (`declined` says
        why: its whole pool cannot hold it, or its pages did not free in time), nothing streams, and a
        sequence whose K/V depend on more than its token ids (media rows, explicit positions) fails its
        item with that reason, as the receiver could not recompute it."""
        ...

    def reserve_kv(self, request_id: str, kv_slot: str, offer: KVOffer, granted: KVGranted,
                   withdrawn: KVWithdrawn) -> bool:
        """Take pages for an offered sequence, now or, behind earlier offers, once enough are free: the
        leading ones this engine's prefix cache holds and free ones for the rest, kept until `submit_with_kv`
        or the request's release; then `granted` is called (from this call, a later `step`, `release`,
        `place_kv`, `submit_with_kv` or `expire_kv`) with the number of leading tokens held (their K/V need
        not travel). An offer still queued at its deadline is dropped and `withdrawn` called instead
        (`expire_kv`). False, nothing taken or queued: the offer can never fit (more pages than the whole pool)."""
        ...

    def expire_kv(self, now: float) -> None:
        """Withdraw the queued offers whose deadline (the engine's `kv_offer_timeout_s` after `reserve_kv`)
        is `now` (`time.monotonic()`) or earlier: each one's `withdrawn` is called and it holds nothing;
        offers queued behind them may then be granted."""
        ...

    def place_kv(self, request_id: str, kv_slot: str, layer: int, start: int, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """Write one `KVStreamSink.layer` call's K/V into the reserved pages (ignored when none are)."""
        ...

    def submit_with_kv(self, item: StepItem, done: KVStreamEnd | None) -> None:
        """`submit` for the first item of a reserved sequence whose every layer is placed (`done`); with no
        free seat it waits for one, holding its pages. None (or no reservation left) starts as any other
        item, recomputing what it needs; a moved sequence whose K/V depend on more than its tokens then fails."""
        ...
