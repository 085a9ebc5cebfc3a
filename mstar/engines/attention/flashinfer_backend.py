"""Paged attention with FlashInfer (the `flashinfer` package, imported lazily): a CUDA fast path.

Written against FlashInfer's documented wrapper API (0.2 and later: `plan()` then `run()`);
tests/gpu/test_flashinfer_attention_gpu.py checks it against SDPA with a real FlashInfer, where flashinfer
imports, and tests/unit/test_flashinfer_backend.py against a torch stand-in of the documented semantics.

Cache: k/v caches [num_layers, num_pages + 1, page_size, Hkv, D], i.e. SDPABackend's layout, which
is FlashInfer's "NHD" layout passed as a (k_cache[layer], v_cache[layer]) tuple. Page `num_pages`
is a scratch page that the block pool never hands out: padded rows and slots of -1 write and read
only there. New K/V rows are stored by slot (`index_copy_`), like the other backends.

Per batch, `prepare` turns block tables and lengths into FlashInfer's CSR page description
(flashinfer_index.py) and plans one wrapper:
- decode batches (every query length 1): `BatchDecodeWithPagedKVCacheWrapper` (tensor-core path,
  which serves any GQA group size);
- prefill / mixed batches: `BatchPrefillWithPagedKVCacheWrapper` with `causal` (bottom-right
  aligned: a sequence's new tokens are its last ones) or not;
- sliding window N: `window_left = N - 1` (FlashInfer's window is inclusive), causal batches only,
  as in SDPABackend.
`plan` needs the query head count, which `KVLayout` does not carry: pass `num_qo_heads`, or the
first `forward` learns it (and plans then); later batches plan inside `prepare`.

CUDA-graph contract (decode batches), FlashInfer's documented graph mode:
- `prepare(meta, pad_to)` uses one decode wrapper per `pad_to`, built with `use_cuda_graph=True` over
  fixed index buffers (slices of persistent tensors sized by `max_num_seqs` and
  `max_pages_per_seq`); its `plan()` runs eagerly before every replay and only rewrites those
  buffers and the wrapper's workspace. Rows past the batch get one token on the scratch page.
- `forward` stores K/V through a persistent slot buffer and calls `run()`: no host sync, no plan.
  Capture after one eager forward per size (that one may plan, and FlashInfer may JIT-compile).
- Padded rows return finite values (attention over the scratch page), not zeros; callers drop them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mstar.engines.attention.base import AttentionMetadata, padded_rows
from mstar.engines.attention.flashinfer_index import PagedIndex, paged_index
from mstar.engines.base import KVLayout

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # FlashInfer's attention kernels take no float32
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # head sizes FlashInfer's FA2 kernels dispatch (vLLM checks the same)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial results)


@dataclass
class _GraphBuffers:
    """Index tensors that captured decode graphs read; allocated once, rewritten before each replay."""

    kv_indptr: torch.Tensor  # [max_num_seqs + 1] int32
    kv_indices: torch.Tensor  # [max_num_seqs * max_pages_per_seq] int32
    last_page_len: torch.Tensor  # [max_num_seqs] int32
    slots: torch.Tensor  # [max_num_seqs] int64: cache slot of each decode row


@dataclass
class _Plan:
    """A prepared batch waiting for its `plan()` call (which needs the query head count)."""

    index: PagedIndex
    indices: torch.Tensor  # [pages] int32 page ids on the device
    wrapper: Any
    decode: bool
    causal: bool
    window_left: int


class FlashInferBackend:
    """Owns the paged K/V tensors of one model and attends with FlashInfer (see module docstring)."""

    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, device: torch.device | str,
                 scale: float | None = None, max_num_seqs: int = 256, max_pages_per_seq: int | None = None,
                 num_qo_heads: int | None = None, workspace_bytes: int = WORKSPACE_BYTES,
                 self_check: bool = True, require_cuda: bool = True) -> None:
        """`self_check` plans and runs a one-token batch now, so that a FlashInfer that cannot load or build
        its kernels fails here; `require_cuda=False` lets tests run with a CPU stand-in module."""
        self.device = torch.device(device)
        _check_supported(layout, self.device, require_cuda)
        self._fi = _import_flashinfer()
        self.layout, self.page_size = layout, page_size
        self.scale = scale if scale is not None else 1.0 / math.sqrt(layout.head_dim)
        self.max_num_seqs = max_num_seqs
        self.max_pages_per_seq = max_pages_per_seq if max_pages_per_seq is not None else num_pages
        self.num_qo_heads = num_qo_heads
        self.scratch_page = num_pages  # one page past the pool's pages
        shape = (layout.num_layers, num_pages + 1, page_size, layout.num_kv_heads, layout.head_dim)
        self.k_cache = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        # FlashInfer asks for a zeroed workspace before first use; every wrapper shares it (one stream).
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._decode_eager: Any = None
        self._prefill: Any = None
        self._decode_graph: dict[int, Any] = {}  # pad_to -> wrapper built with use_cuda_graph=True
        self._graph_buffers: _GraphBuffers | None = None
        self._pending: _Plan | None = None
        self._wrapper: Any = None  # the planned wrapper `forward` runs
        self._planned_heads = 0
        self._num_tokens = 0
        self._slots: torch.Tensor | None = None
        # plan() stages its schedule in a pinned host buffer copied asynchronously; wait for the previous
        # copy before the next plan overwrites it (decode lookahead prepares while the GPU is busy).
        self._plan_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self.is_decode = False  # the last prepared batch had only query lengths of 1
        self.num_rows = 0  # rows of the last prepared batch (pad_to for padded decode)
        if self_check:
            self._self_check()

    def prepare(self, meta: AttentionMetadata, pad_to: int | None = None) -> None:
        """Describe the batch to FlashInfer (and plan it once the query head count is known)."""
        num_seqs = len(meta.query_lens)
        self.is_decode = all(q == 1 for q in meta.query_lens)
        rows = self._check(meta, pad_to)
        index = paged_index(meta.query_lens, meta.seq_lens, self.page_size, meta.block_tables.shape[1], rows)
        indices = self._page_ids(index, meta.block_tables)
        self._slots = self._slot_ids(meta.slot_mapping, num_seqs, rows, pad_to is not None)
        wrapper = self._decode_wrapper(pad_to) if self.is_decode else self._prefill_wrapper()
        window_left = meta.sliding_window - 1 if meta.causal and meta.sliding_window else -1
        self._pending = _Plan(index, indices, wrapper, self.is_decode, meta.causal, window_left)
        self.num_rows, self._num_tokens = rows, int(index.qo_indptr[-1])
        if self.num_qo_heads is not None:
            self._plan(self.num_qo_heads)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k/v at the batch's slots, then attend each sequence's new tokens over its prefix."""
        if self._slots is None:
            raise RuntimeError("FlashInferBackend.forward called before prepare")
        if q.shape[0] != self._num_tokens:
            raise ValueError(f"q has {q.shape[0]} rows but the prepared batch has {self._num_tokens} "
                             "tokens (a padded decode batch takes pad_to rows)")
        if self._pending is not None:  # first batch: the query head count comes with q
            self.num_qo_heads = q.shape[1]
            self._plan(q.shape[1])
        elif q.shape[1] != self._planned_heads:
            raise ValueError(f"q has {q.shape[1]} heads but the batch was planned for {self._planned_heads}; "
                             "pass the model's query head count as num_qo_heads")
        dtype = self.k_cache.dtype
        k_flat = self.k_cache[layer].view(-1, *self.k_cache.shape[-2:])
        v_flat = self.v_cache[layer].view(-1, *self.v_cache.shape[-2:])
        k_flat.index_copy_(0, self._slots, k.to(dtype))
        v_flat.index_copy_(0, self._slots, v.to(dtype))
        out = self._wrapper.run(q.to(dtype).contiguous(), (self.k_cache[layer], self.v_cache[layer]))
        return out.to(q.dtype)

    def _check(self, meta: AttentionMetadata, pad_to: int | None) -> int:
        rows = padded_rows(meta, pad_to, self.is_decode)
        if pad_to is not None and rows > self.max_num_seqs:
            raise ValueError(f"batch of {rows} sequences exceeds FlashInferBackend max_num_seqs="
                             f"{self.max_num_seqs}; raise max_num_seqs")
        pages = max(-(-s // self.page_size) for s in meta.seq_lens)
        if pages > self.max_pages_per_seq:
            raise ValueError(f"a sequence of {max(meta.seq_lens)} tokens needs {pages} pages > "
                             f"max_pages_per_seq={self.max_pages_per_seq}; raise max_pages_per_seq")
        return rows

    def _page_ids(self, index: PagedIndex, block_tables: torch.Tensor) -> torch.Tensor:
        """`indices` on the device: the block-table entries `index.gather` names, then scratch pages."""
        real = len(index.gather)
        if block_tables.device.type == "cpu":  # pinned staging (graph decode): gather on the host
            ids = np.full(real + index.num_pad_pages, self.scratch_page, dtype=np.int32)
            ids[:real] = block_tables.reshape(-1).numpy()[index.gather]
            return torch.from_numpy(ids).to(self.device, non_blocking=True)
        ids_dev = torch.full((real + index.num_pad_pages,), self.scratch_page, dtype=torch.int32,
                             device=self.device)
        if real:
            gather = torch.from_numpy(index.gather).to(block_tables.device, non_blocking=True)
            ids_dev[:real] = block_tables.reshape(-1).index_select(0, gather)
        return ids_dev

    def _slot_ids(self, slot_mapping: torch.Tensor, num_seqs: int, rows: int, graph: bool) -> torch.Tensor:
        """Cache slots of the new tokens; padded rows and slots < 0 go to the scratch page."""
        scratch = self.scratch_page * self.page_size
        if not graph:
            slots = slot_mapping.to(self.device, dtype=torch.long, non_blocking=True)
            return slots.masked_fill(slots < 0, scratch)  # out of place: the caller's tensor stays as it was
        buf = self._buffers().slots[:rows]  # graphs read this buffer: rewrite it in place
        buf[:num_seqs].copy_(slot_mapping, non_blocking=True)
        buf[num_seqs:].fill_(scratch)
        return buf.masked_fill_(buf < 0, scratch)

    # Buffers and wrappers (FlashInfer allocates workspaces in them) are made lazily, often inside the
    # engine's inference mode; made as normal tensors, later in-place updates work in either mode.
    @torch.inference_mode(False)
    def _buffers(self) -> _GraphBuffers:
        if self._graph_buffers is None:
            n, dev = self.max_num_seqs, self.device
            self._graph_buffers = _GraphBuffers(
                torch.zeros(n + 1, dtype=torch.int32, device=dev),
                torch.zeros(n * self.max_pages_per_seq, dtype=torch.int32, device=dev),
                torch.ones(n, dtype=torch.int32, device=dev),
                torch.zeros(n, dtype=torch.long, device=dev))
        return self._graph_buffers

    @torch.inference_mode(False)
    def _decode_wrapper(self, pad_to: int | None) -> Any:
        cls = self._fi.BatchDecodeWithPagedKVCacheWrapper
        if pad_to is None:
            if self._decode_eager is None:
                self._decode_eager = cls(self._workspace, "NHD", use_tensor_cores=True)
            return self._decode_eager
        if pad_to not in self._decode_graph:
            b = self._buffers()
            self._decode_graph[pad_to] = cls(
                self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=b.kv_indptr[: pad_to + 1], paged_kv_indices_buffer=b.kv_indices,
                paged_kv_last_page_len_buffer=b.last_page_len[:pad_to])
        return self._decode_graph[pad_to]

    @torch.inference_mode(False)
    def _prefill_wrapper(self) -> Any:
        if self._prefill is None:
            self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        return self._prefill

    def _plan(self, heads: int) -> None:
        """Call the pending batch's `plan()` (host work, outside any graph capture)."""
        p = self._pending
        assert p is not None
        if self._plan_copied is not None:
            self._plan_copied.synchronize()
        layout, dtype = self.layout, self.k_cache.dtype
        shape = (heads, layout.num_kv_heads, layout.head_dim, self.page_size)
        common = dict(window_left=p.window_left, sm_scale=self.scale, q_data_type=dtype, kv_data_type=dtype)
        indptr, last = torch.from_numpy(p.index.kv_indptr), torch.from_numpy(p.index.last_page_len)
        if p.decode:
            p.wrapper.plan(indptr, p.indices, last, *shape, pos_encoding_mode="NONE", **common)
        else:
            p.wrapper.plan(torch.from_numpy(p.index.qo_indptr), indptr, p.indices, last, *shape,
                           causal=p.causal, **common)
        if self._plan_copied is not None:
            self._plan_copied.record()
        self._wrapper, self._planned_heads, self._pending = p.wrapper, heads, None

    def _self_check(self) -> None:
        """One decode and one prefill batch on the scratch page: loads (or JIT-builds) the kernels now."""
        given, layout = self.num_qo_heads, self.layout
        heads = given or layout.num_kv_heads
        table = torch.full((1, 2), self.scratch_page, dtype=torch.int32)
        for n in (1, 2):
            self.prepare(AttentionMetadata([n], [n], torch.full((n,), -1, dtype=torch.long), table))
            q = torch.zeros(n, heads, layout.head_dim, dtype=layout.dtype, device=self.device)
            kv = torch.zeros(n, layout.num_kv_heads, layout.head_dim, dtype=layout.dtype, device=self.device)
            out = self.forward(0, q, kv, kv)
            if out.shape != q.shape or not bool(torch.isfinite(out).all()):
                raise RuntimeError(f"FlashInfer self-check gave output {tuple(out.shape)} with non-finite "
                                   "values or the wrong shape; use attention backend 'triton' or 'sdpa'")
        self.num_qo_heads, self._slots = given, None
        logger.debug("FlashInfer self-check passed (head_dim %d, %s)", layout.head_dim, layout.dtype)


def _check_supported(layout: KVLayout, device: torch.device, require_cuda: bool) -> None:
    if require_cuda and device.type != "cuda":
        raise ValueError(f"attention backend 'flashinfer' needs a CUDA device, got {device}; "
                         "use kv_cache.attention_backend 'sdpa' (or 'auto')")
    if layout.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"attention backend 'flashinfer' takes float16/bfloat16 KV caches, got {layout.dtype}; "
                         "use kv_cache.attention_backend 'triton' or 'sdpa' (or 'auto')")
    if layout.head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"attention backend 'flashinfer' takes head_dim in {SUPPORTED_HEAD_DIMS}, got "
                         f"{layout.head_dim}; use kv_cache.attention_backend 'triton' or 'sdpa' (or 'auto')")


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError("attention backend 'flashinfer' needs the flashinfer package "
                          "(pip install flashinfer-python); or use kv_cache.attention_backend "
                          "'auto', 'triton' or 'sdpa'") from exc
    return flashinfer
