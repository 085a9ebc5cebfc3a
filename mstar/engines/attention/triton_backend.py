"""Paged attention with Triton kernels (`mstar.kernels`): the fast path on CUDA.

Same cache layout as SDPABackend: k/v caches [num_layers, num_pages, page_size, Hkv, D].

CUDA-graph contract (decode batches):
- The constructor allocates every index buffer the kernels read (seq_lens, block_tables
  [max_num_seqs, max_pages_per_seq], slot_mapping, query starts); they never move.
- `prepare(meta, pad_to)` runs eagerly before each step (outside the graph) and only copies into
  those buffers (pinned host staging, non-blocking copies on the current stream). For a decode
  batch (every query length 1) `pad_to` >= B pads it to `pad_to` rows with seq_len 0 and slot -1:
  padded rows write nothing to the cache and return zeros.
- `share_decode_buffers` (optional, before any capture) makes seq_lens, slot_mapping and
  block_tables views of the caller's packed input buffer (autoregressive/decode_inputs.py); the
  caller then stages a decode batch there itself, in one copy with its other inputs, and
  `prepare_staged_decode(num_seqs, rows)` describes it without copying anything.
- `forward` only launches kernels: no host sync, no allocation whose size depends on data; grids
  depend on `pad_to` (or B) and the tensor shapes alone. So a graph that captured the `forward`s
  of a decode batch of `pad_to` rows replays correctly after any later `prepare(meta, pad_to)` with
  B <= pad_to and any lengths up to max_pages_per_seq pages. Run one eager forward per batch size
  before capturing (Triton compiles on first launch).

Decode batches take one split-KV attention launch (which also stores the new K/V) plus a small
reduce when split. Prefill / mixed batches store K/V, then run the varlen kernel, whose grid uses
the host-side max query length from `prepare` (no sync either).

CUDA-graph contract (steps with prompt tokens, `autoregressive/prefill_graph.py`):
`reserve_graphed_prefill(T)` (once, before any capture) allocates a persistent slot buffer of T
tokens; `prepare_graphed_prefill(meta, tokens)` describes a batch of at most `tokens` new tokens with
the grids of `tokens` query tokens over all `max_num_seqs` rows: rows past the batch get no queries
(their query start is the batch's token count) and length 0, tokens past the batch slot -1. A graph
captured after `prepare_graphed_prefill(..., T)` replays any later batch prepared with the same T.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from mstar.engines.attention.base import AttentionMetadata, padded_rows
from mstar.engines.base import KVLayout


class TritonBackend:
    """Owns the paged K/V tensors of one model and attends with Triton kernels (see module docstring)."""

    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, device: torch.device | str,
                 scale: float | None = None, max_num_seqs: int = 256,
                 max_pages_per_seq: int | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention backend 'triton' needs a CUDA device, got {self.device}; "
                             "use kv_cache.attention_backend 'sdpa' (or 'auto')")
        self.page_size = page_size
        self.scale = scale if scale is not None else 1.0 / math.sqrt(layout.head_dim)
        self.max_num_seqs = max_num_seqs
        self.max_pages_per_seq = max_pages_per_seq if max_pages_per_seq is not None else num_pages
        shape = (layout.num_layers, num_pages, page_size, layout.num_kv_heads, layout.head_dim)
        self.k_cache = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        self._alloc_buffers()
        self._kernels: tuple | None = None  # imported at the first forward: triton loads slowly
        # Splits target ~2 decode programs per SM; tests may lower `num_sms` to exercise the paths.
        on_cuda = self.device.type == "cuda"
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if on_cuda else 8
        self.is_decode = False  # the last prepared batch had only query lengths of 1
        self.num_rows = 0  # rows of the last prepared batch (pad_to for padded decode)
        self._num_seqs = 0
        self._max_query_len = 0
        self._causal = True
        self._window = 0
        self._slots: torch.Tensor | None = None
        self._prefill_slots: torch.Tensor | None = None  # persistent slots of graphed prefill steps

    def _alloc_buffers(self) -> None:
        n, dev = self.max_num_seqs, self.device
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.q_starts = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.max_pages_per_seq, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        pin = dev.type == "cuda"
        # Host staging: [seq_lens (n) | q_starts (n + 1)]; one pinned buffer, two small copies per step.
        self._staging = torch.zeros(2 * n + 1, dtype=torch.int32, pin_memory=pin)
        self._staging_np = self._staging.numpy()
        self._staged = torch.cuda.Event() if pin else None

    def prepare(self, meta: AttentionMetadata, pad_to: int | None = None) -> None:
        """Copy the batch description into the persistent buffers (see the module docstring)."""
        num_seqs = len(meta.query_lens)
        self.is_decode = meta.query_lens.count(1) == num_seqs
        rows = self._check(meta, pad_to)
        self._stage(meta, num_seqs, rows)
        if self.is_decode:
            self.slot_mapping[:num_seqs].copy_(meta.slot_mapping, non_blocking=True)
            self.slot_mapping[num_seqs:rows].fill_(-1)
            self._slots = self.slot_mapping[:rows]
        else:
            self._slots = meta.slot_mapping.to(self.device, non_blocking=True)
        self._describe(meta, rows, num_seqs, max(meta.query_lens))

    def reserve_graphed_prefill(self, max_tokens: int) -> None:
        """Allocate the slot buffer of graphed prefill steps of up to `max_tokens` tokens (before any
        capture: graphs read the buffer they were captured with)."""
        if self._prefill_slots is None or self._prefill_slots.numel() < max_tokens:
            with torch.inference_mode(False):  # a normal tensor: updated in place in and out of inference mode
                self._prefill_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=self.device)

    def prepare_graphed_prefill(self, meta: AttentionMetadata, tokens: int) -> None:
        """`prepare` for a step replayed from a graph captured at `tokens` tokens (module docstring)."""
        slots = self._prefill_slots
        num_seqs, n = len(meta.query_lens), sum(meta.query_lens)
        if slots is None or not n <= tokens <= slots.numel():
            raise ValueError(f"a graphed prefill step of {n} tokens in a bucket of {tokens} needs "
                             f"reserve_graphed_prefill(>= {tokens}) first and n <= tokens")
        self.is_decode = False
        self._check(meta, None)
        rows = self.max_num_seqs
        self._stage(meta, num_seqs, rows, q_rows=rows)
        slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        slots[n:tokens].fill_(-1)
        self._slots = slots[:tokens]
        self._describe(meta, rows, rows, tokens)  # every row: the graph's grids cover the whole bucket

    def _describe(self, meta: AttentionMetadata, rows: int, seqs: int, max_query_len: int) -> None:
        """The block tables and the batch's shape for the kernels (the end of both `prepare`s)."""
        self.block_tables[: len(meta.query_lens), : meta.block_tables.shape[1]].copy_(meta.block_tables,
                                                                                      non_blocking=True)
        self.num_rows, self._num_seqs = rows, seqs
        self._max_query_len = max_query_len
        self._causal = meta.causal
        self._window = (meta.sliding_window or 0) if meta.causal else 0

    def share_decode_buffers(self, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                             block_tables: torch.Tensor) -> None:
        """Read sequence lengths, slot ids and block tables from these device tensors from now on (views
        of the caller's packed buffer, same shapes and dtypes as the backend's own), so that a decode
        batch the caller staged there needs no copy (`prepare_staged_decode`); `prepare` keeps filling
        them for every other batch. Call it before capturing graphs: a graph reads the buffers it was
        captured with."""
        for name, new, own in (("seq_lens", seq_lens, self.seq_lens), ("slot_mapping", slot_mapping, self.slot_mapping),
                               ("block_tables", block_tables, self.block_tables)):
            if new.shape != own.shape or new.dtype != own.dtype or new.device != own.device:
                raise ValueError(f"shared {name} {tuple(new.shape)} {new.dtype} on {new.device} does not match "
                                 f"{tuple(own.shape)} {own.dtype} on {own.device}")
        self.seq_lens, self.slot_mapping, self.block_tables = seq_lens, slot_mapping, block_tables
        self._slots = None
        self._slot_rows = [slot_mapping[:k] for k in range(self.max_num_seqs + 1)]

    def prepare_staged_decode(self, num_seqs: int, rows: int) -> None:
        """`prepare` for a decode batch of `num_seqs` sequences padded to `rows`, whose lengths (0 past
        `num_seqs`), slots (-1 past it) and block tables the caller has already queued into the shared
        buffers (`share_decode_buffers`). Checks nothing: the caller built the rows to fit."""
        self.is_decode = True
        self._slots = self._slot_rows[rows]
        self.num_rows, self._num_seqs = rows, num_seqs
        self._max_query_len, self._causal, self._window = 1, True, 0

    def _check(self, meta: AttentionMetadata, pad_to: int | None) -> int:
        rows = padded_rows(meta, pad_to, self.is_decode)
        if rows > self.max_num_seqs:
            raise ValueError(f"batch of {rows} sequences exceeds TritonBackend max_num_seqs="
                             f"{self.max_num_seqs}; raise max_num_seqs")
        pages = -(-max(meta.seq_lens) // self.page_size)  # of the longest sequence
        if max(pages, meta.block_tables.shape[1]) > self.max_pages_per_seq:
            raise ValueError(f"a sequence of {max(meta.seq_lens)} tokens needs {pages} pages (block table "
                             f"width {meta.block_tables.shape[1]}) > max_pages_per_seq="
                             f"{self.max_pages_per_seq}; raise max_pages_per_seq")
        return rows

    def _stage(self, meta: AttentionMetadata, num_seqs: int, rows: int, q_rows: int | None = None) -> None:
        """seq_lens (zero-padded to `rows`) and, unless decoding (the decode kernel reads none), query
        starts -> device, via pinned memory; with `q_rows`, query starts for that many rows (those past
        the batch start at its token count: no queries)."""
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copy must have left the staging buffer
        n = self.max_num_seqs
        host = self._staging_np
        host[:num_seqs] = meta.seq_lens
        host[num_seqs:rows] = 0
        self.seq_lens[:rows].copy_(self._staging[:rows], non_blocking=True)
        if not self.is_decode:
            host[n] = 0
            np.cumsum(meta.query_lens, out=host[n + 1 : n + 1 + num_seqs])
            q_rows = q_rows or num_seqs
            host[n + 1 + num_seqs : n + 1 + q_rows] = host[n + num_seqs]
            self.q_starts[: q_rows + 1].copy_(self._staging[n : n + 1 + q_rows], non_blocking=True)
        if self._staged is not None:
            self._staged.record()

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k/v at the batch's slots, then attend each sequence's new tokens over its prefix."""
        assert self._slots is not None, "TritonBackend.forward called before prepare"
        if self.is_decode:  # the decode kernel stores k/v itself
            return self._decode(layer, q, k, v)
        if self._kernels is None:
            self._kernels = _load_kernels()
        store_kv, _, _, prefill_attention = self._kernels
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        store_kv(k, v, k_cache, v_cache, self._slots)
        b = self._num_seqs
        return prefill_attention(q, k_cache, v_cache, self.block_tables[:b], self.q_starts[: b + 1],
                                 self.seq_lens[:b], self._max_query_len, self.scale, self._causal, self._window)


    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self._slots is not None, "TritonBackend.forward called before prepare"
        if self._kernels is None:
            self._kernels = _load_kernels()
        _, decode_attention, decode_num_splits, _ = self._kernels
        rows = self.num_rows
        # The split count is a function of the padded batch and max_pages_per_seq only: graph-static.
        splits = decode_num_splits(rows, k.shape[1], self.num_sms, self.max_pages_per_seq * self.page_size)
        return decode_attention(q, k, v, self.k_cache[layer], self.v_cache[layer], self._slots,
                                self.block_tables[:rows], self.seq_lens[:rows], self.scale, self._window, splits)


def _load_kernels() -> tuple:
    """The kernel launchers; imported here so that importing this module does not import triton."""
    from mstar.kernels.decode_attention import decode_attention, decode_num_splits
    from mstar.kernels.kv_store import store_kv
    from mstar.kernels.prefill_attention import prefill_attention

    return store_kv, decode_attention, decode_num_splits, prefill_attention
