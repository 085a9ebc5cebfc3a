"""Paged attention with torch's scaled_dot_product_attention: works on CPU and GPU.

The reference backend: sequences of a packed batch are padded to one [B, Hq, Lq, Lk] problem
and masked, so it stays one SDPA call per layer; a decode batch (one new token per sequence) is
[B, Hkv, groups, Lk] instead, each kv head's query heads as rows, so no key is copied per query head.
It is the CPU backend; the faster backends (Triton, FlashInfer) implement the same interface on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.engines.attention.base import AttentionMetadata
from mstar.engines.base import KVLayout


class _Batch:
    """Index tensors derived once per `prepare` and shared by every layer."""

    def __init__(self, meta: AttentionMetadata, page_size: int, device: torch.device) -> None:
        qlens = torch.tensor(meta.query_lens, dtype=torch.long, device=device)
        slens = torch.tensor(meta.seq_lens, dtype=torch.long, device=device)
        self.max_q = max(meta.query_lens)
        self.decode = self.max_q == 1  # one new token per sequence: packed rows are the batch's rows
        max_pages = -(-max(meta.seq_lens) // page_size)
        self.block_tables = meta.block_tables[:, :max_pages].to(device=device, dtype=torch.long)
        self.pages = self.block_tables.flatten()  # index_select takes 1-D indices (faster than [block_tables])
        max_k = max_pages * page_size
        # Row/column of each packed new token inside the padded [B, max_q] query grid.
        batch_idx = torch.repeat_interleave(torch.arange(len(meta.query_lens), device=device), qlens)
        starts = torch.cumsum(qlens, 0) - qlens
        q_idx = torch.arange(int(qlens.sum()), device=device) - starts[batch_idx]
        self.batch_idx, self.q_idx = batch_idx, q_idx
        self.mask = _build_mask(qlens, slens, self.max_q, max_k, meta.causal, meta.sliding_window)
        self.slot_mapping = meta.slot_mapping.to(device)


def _build_mask(qlens: torch.Tensor, slens: torch.Tensor, max_q: int, max_k: int,
                causal: bool, window: int | None) -> torch.Tensor:
    """Boolean [B, 1, max_q, max_k] mask: True where a query may attend a key."""
    device = qlens.device
    q_pos = (slens - qlens)[:, None] + torch.arange(max_q, device=device)[None, :]  # absolute positions
    k_pos = torch.arange(max_k, device=device)[None, None, :]
    mask = (k_pos < slens[:, None, None]).expand(-1, max_q, -1).clone()
    if causal:
        mask = mask & (k_pos <= q_pos[:, :, None])
        if window is not None:  # sliding windows only make sense for causal attention
            mask = mask & (k_pos > q_pos[:, :, None] - window)
    # Padding query rows attend to key 0 so that SDPA never sees an all-masked row (NaN).
    pad_rows = torch.arange(max_q, device=device)[None, :] >= qlens[:, None]
    mask[..., 0] |= pad_rows
    return mask[:, None]


class SDPABackend:
    """Owns the paged K/V tensors ([num_layers, num_pages, page_size, Hkv, D] each) of one model."""

    def __init__(self, layout: KVLayout, num_pages: int, page_size: int,
                 device: torch.device | str, scale: float | None = None) -> None:
        self.device = torch.device(device)
        self.page_size = page_size
        self.scale = scale
        shape = (layout.num_layers, num_pages, page_size, layout.num_kv_heads, layout.head_dim)
        self.k_cache = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        self._batch: _Batch | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        """Set the packed batch that the next `forward` calls (one per layer) describe."""
        self._batch = _Batch(meta, self.page_size, self.device)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k/v at the batch's slots, then attend each sequence's new tokens over its prefix."""
        b = self._batch
        assert b is not None, "SDPABackend.forward called before prepare"
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_flat = self.k_cache[layer].view(-1, num_kv_heads, head_dim)
        v_flat = self.v_cache[layer].view(-1, num_kv_heads, head_dim)
        k_flat[b.slot_mapping] = k.to(k_flat.dtype)
        v_flat[b.slot_mapping] = v.to(v_flat.dtype)
        # Gather each sequence's pages into a contiguous [B, Lk, Hkv, D] view of its keys/values.
        num_seqs = b.block_tables.shape[0]
        keys = self.k_cache[layer].index_select(0, b.pages).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = self.v_cache[layer].index_select(0, b.pages).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
        groups = q.shape[1] // num_kv_heads  # GQA: each kv head serves `groups` query heads
        if b.decode:
            # A kv head's `groups` query heads attend as that many query rows under one key mask: no
            # copies of the keys per query head, no padded query grid.
            out = F.scaled_dot_product_attention(q.reshape(num_seqs, num_kv_heads, groups, head_dim),
                                                 keys.to(q.dtype), values.to(q.dtype), attn_mask=b.mask,
                                                 scale=self.scale)
            # reshape: the GPU kernels may return these rows in a layout a view cannot fold
            return out.reshape(num_seqs, q.shape[1], head_dim)
        q_pad = q.new_zeros(num_seqs, b.max_q, q.shape[1], head_dim)
        q_pad[b.batch_idx, b.q_idx] = q
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            keys.repeat_interleave(groups, dim=1).to(q.dtype),
            values.repeat_interleave(groups, dim=1).to(q.dtype),
            attn_mask=b.mask,
            scale=self.scale,
        )
        return out.transpose(1, 2)[b.batch_idx, b.q_idx]
