"""The contract by which an autoregressive sequence moves between engines of one component on different
workers (prefill/decode disaggregation): what moves (`KVExport`, with its M-RoPE `KVPositions`) and the
engine side of the move (`KVHandoff`); engines/autoregressive/kv_transfer.py implements it for paged caches
and worker/kv_moves.py carries it between workers."""

from __future__ import annotations

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
class KVExport:
    """A computed sequence moved from one engine to another (prefill/decode disaggregation): every
    token, the chained hashes of its full shareable pages, and the K/V of its pages from `skip` on
    (the receiver holds the first `skip`, found by the same hashes in its prefix cache)."""

    tokens: list[int]  # every token of the sequence; all of them computed
    page_hashes: list[int]
    skip: int
    k: torch.Tensor | None  # [layers, pages - skip, page_size, kv_heads, head_dim]; None when nothing is sent
    v: torch.Tensor | None
    positions: KVPositions | None = None  # None: positions are the token indexes


@runtime_checkable
class KVHandoff(Protocol):
    """An engine whose sequences can move to another worker's engine of the same component: the
    receiver `hold_prefix`es what its prefix cache has of the item's prompt, the sender
    `export_kv`s the sequence (dropping it), the receiver `submit_with_kv`s the item with it."""

    def hold_prefix(self, item: StepItem) -> list[int]:
        """Hashes of the leading full pages of `item`'s prompt this engine has cached, held (not
        evictable) until `submit_with_kv` or the request's release."""
        ...

    def export_kv(self, request_id: str, kv_slot: str, held: list[int]) -> KVExport | None:
        """The sequence, its pages after the common prefix with `held` only, and forget it here;
        None when this engine holds no fully computed sequence of that key."""
        ...

    def submit_with_kv(self, item: StepItem, export: KVExport | None) -> None:
        """`submit` for the first item of a sequence whose K/V come in `export` (None: the item
        starts as any other, recomputing what it needs)."""
        ...
