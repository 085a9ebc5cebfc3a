"""The interface every attention backend implements (SDPA, the reference; Triton and FlashInfer, on CUDA).

Model code never sees pages. Each attention layer calls

    out = backend.forward(layer_idx, q, k, v)     # q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]

where T is the total number of new tokens of the batch, requests packed one after another in
the order given by the `AttentionMetadata` the engine set with `backend.prepare(meta)` before
the model's forward. The backend writes k/v into the paged cache at `slot_mapping` and attends
each request's new tokens over its cached prefix plus its own new tokens (causal).

What CUDA-graph replay needs of a backend is declared apart (`GraphedAttention`, `SharedDecodeAttention`,
`GraphedPrefillAttention`), and the runner checks for those once, when it is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class AttentionMetadata:
    """Describes one packed batch for the attention backend. All tensors on the model's device."""

    query_lens: list[int]  # new tokens per sequence in this step (prefill chunk length, or 1 for decode)
    seq_lens: list[int]  # total tokens per sequence after this step (cached prefix + new)
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (page * page_size + offset) for each new token
    block_tables: torch.Tensor  # [B, max_pages] int32: pages of each sequence, padded with 0
    causal: bool = True  # False for bidirectional blocks (e.g. image tokens attended all at once)
    sliding_window: int | None = None  # attend only to the last N positions, when the model needs it


class AttentionBackend(Protocol):
    """Paged attention over a KV cache the backend owns."""

    def prepare(self, meta: AttentionMetadata) -> None:
        """Set the batch description used by the following `forward` calls."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k/v for the new tokens of layer `layer` and return attention output [T, Hq, D]."""


@runtime_checkable
class PagedCacheAttention(AttentionBackend, Protocol):
    """A backend whose caches its owner may also read and write by page (a component keeping contexts of
    its own: engines/kv_cache/paged.py): `k_cache`/`v_cache` [num_layers, pages, page_size, Hkv, D]."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor


@runtime_checkable
class GraphedAttention(AttentionBackend, Protocol):
    """A backend whose decode steps can be captured in CUDA graphs: `prepare(meta, pad_to=rows)` fills
    buffers of fixed addresses for a decode batch padded to `rows` (a graph's size), at most
    `max_num_seqs` rows of at most `max_pages_per_seq` pages each."""

    max_num_seqs: int
    max_pages_per_seq: int

    def prepare(self, meta: AttentionMetadata, pad_to: int | None = None) -> None: ...


@runtime_checkable
class SharedDecodeAttention(GraphedAttention, Protocol):
    """A graphed backend that reads its decode buffers from the engine's packed decode inputs
    (`DecodeInputs`), so that a staged decode batch costs no copy: `share_decode_buffers` hands it those
    views once, before capture; `prepare_staged_decode(num_seqs, rows)` is `prepare` for a batch the
    engine has already written there."""

    def share_decode_buffers(self, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                             block_tables: torch.Tensor) -> None: ...

    def prepare_staged_decode(self, num_seqs: int, rows: int) -> None: ...


@runtime_checkable
class GraphedPrefillAttention(GraphedAttention, Protocol):
    """A graphed backend that can also replay steps with prompt tokens from graphs of `tokens` query
    tokens (`PrefillGraphs`): `prepare_graphed_prefill` prepares such a step."""

    def prepare_graphed_prefill(self, meta: AttentionMetadata, tokens: int) -> None: ...


def padded_rows(meta: AttentionMetadata, pad_to: int | None, is_decode: bool) -> int:
    """Rows a prepared batch occupies: its sequences, or `pad_to` for a decode batch replayed in a CUDA
    graph of that size; ValueError when padding is asked for anything else."""
    num_seqs = len(meta.query_lens)
    if pad_to is not None and (not is_decode or pad_to < num_seqs):
        raise ValueError(f"pad_to={pad_to} needs a decode-only batch of at most pad_to sequences "
                         f"(got query_lens={meta.query_lens}); pass pad_to=None for prefill")
    return num_seqs if pad_to is None else pad_to
