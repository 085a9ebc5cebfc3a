"""Triton paged DECODE attention: one query token per sequence, split-KV (flash-decoding).

One program handles (sequence, KV head, split): it loads the whole group of query heads that share
the KV head, so every K/V page is read once per group, and walks its share of the sequence's cached
keys in blocks of BLOCK_N, gathering rows through the block table. The new token's K/V is stored
by the same launch (split 0 writes it and uses it from registers; no program reads that slot),
which saves a kernel launch per layer. Each split writes a normalised
partial output and its log-sum-exp; a small reduce kernel merges the splits. Loop bounds come from
the device `seq_lens`, so one launch (and one captured CUDA graph) is valid for any lengths.

PDL (sm_90+, `mstar.kernels.pdl`): both kernels let the next kernel launch at their start. The reduce
kernel waits for the previous one before it reads anything (the partials). The decode kernel first
reads its sequence's length, block table and the first block of its split's cached keys and values
(`PRELOAD`): lengths and tables are written by copies that precede the step's kernels, the cached
positions before the new token by earlier steps, so none of it by a kernel that may still run. It
waits before everything else (q/k/v, slots, the new token's cache row, partials).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

LOG2E = 1.4426950408889634
MAX_SPLITS = 16


class _Preload:
    """Whether each decode program reads its first block of cached keys and values before its PDL
    wait (`on`); benchmarks switch it to compare. Results do not depend on it."""

    def __init__(self) -> None:
        self.on = True


PRELOAD = _Preload()


@triton.jit
def _new_token(q, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, b, kvh, split, seq_len,
               stride_kb, stride_kh, stride_vb, stride_vh, qk_scale, d, dmask,
               NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Split 0 stores the sequence's new K/V row and starts its softmax state with it; the other
    splits start empty. The new row is taken from registers, so no program reads its slot."""
    owner = split == 0
    k = tl.load(k_ptr + b * stride_kb + kvh * stride_kh + d, mask=dmask & owner, other=0.0)
    v = tl.load(v_ptr + b * stride_vb + kvh * stride_vh + d, mask=dmask & owner, other=0.0)
    k = k.to(k_cache_ptr.dtype.element_ty)  # attend to exactly what the cache will hold
    v = v.to(v_cache_ptr.dtype.element_ty)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d
    tl.store(k_cache_ptr + dst, k, mask=dmask & owner & (slot >= 0))  # slot < 0: padding row
    tl.store(v_cache_ptr + dst, v, mask=dmask & owner & (slot >= 0))
    has_new = owner & (seq_len > 0)
    qk = tl.sum(q.to(tl.float32) * k.to(q.dtype).to(tl.float32)[None, :], 1) * qk_scale
    m_i = tl.where(has_new, qk, float("-inf"))
    l_i = tl.where(has_new, 1.0, 0.0) + tl.zeros([BLOCK_G], tl.float32)
    acc = tl.where(has_new, v.to(q.dtype).to(tl.float32)[None, :], 0.0) + tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    return m_i, l_i, acc


@triton.jit
def kv_rows(block_tables_ptr, b, stride_bt, kvh, start, hi,
            NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(positions n = start.., the mask n < hi, each position's element offset of head `kvh` in a paged
    cache [pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM]) for sequence b, through its block-table row."""
    n = start + tl.arange(0, BLOCK_N)
    nmask = n < hi
    page = tl.load(block_tables_ptr + b * stride_bt + n // PAGE_SIZE, mask=nmask, other=0)
    row = (page.to(tl.int64) * PAGE_SIZE + n % PAGE_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM
    return n, nmask, row


@triton.jit
def _load_block(k_cache_ptr, v_cache_ptr, block_tables_ptr, b, stride_bt, kvh, start, hi, d, dmask,
                NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Cached keys and values [BLOCK_N, BLOCK_D] of positions start.. (masked from `hi` on), gathered
    through the block table, and the mask of the valid positions."""
    _, nmask, row = kv_rows(block_tables_ptr, b, stride_bt, kvh, start, hi, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE,
                            BLOCK_N)
    kv_mask = nmask[:, None] & dmask[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return k, v, nmask


@triton.jit
def attend_block(q, k, v, nmask, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """One block of keys (at least one valid) into the online softmax state (m_i, l_i, acc)."""
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
    qk = tl.where(nmask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_tables_ptr, seq_lens_ptr,
                   out_ptr, lse_ptr, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_bt,
                   stride_ob, stride_oh, stride_os, qk_scale, window,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                   PRELOAD: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    if not PRELOAD:
        pdl_wait(PDL)  # every read after the wait (the wait below then returns at once)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    kv_start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    cached = seq_len - 1  # keys [kv_start, seq_len - 1) come from the cache, the last one from k
    # Splits own whole blocks, so every non-empty loop iteration sees at least one valid key.
    per_split = tl.cdiv(tl.maximum(cached - kv_start, 0), BLOCK_N * NUM_SPLITS) * BLOCK_N
    lo = kv_start + split * per_split
    hi = tl.minimum(lo + per_split, cached)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    # The split's first block of cached keys and values. With PRELOAD it is read before the PDL wait:
    # lengths and block tables are written by copies before the step's kernels, the cached positions
    # before the new token by earlier steps (the contract in mstar/kernels/pdl.py), so its DRAM
    # latency overlaps the previous kernels; at small batches that block is often the split's whole share.
    k0, v0, nmask0 = _load_block(k_cache_ptr, v_cache_ptr, block_tables_ptr, b, stride_bt, kvh, lo, hi, d, dmask,
                                 NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, BLOCK_N)
    pdl_wait(PDL)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m_i, l_i, acc = _new_token(q, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, b, kvh, split, seq_len,
                               stride_kb, stride_kh, stride_vb, stride_vh, qk_scale, d, dmask,
                               NUM_KV_HEADS, HEAD_DIM, BLOCK_G, BLOCK_D)
    if lo < hi:  # an empty split attends to nothing (a block of no valid key would make m - m NaN)
        m_i, l_i, acc = attend_block(q, k0, v0, nmask0, m_i, l_i, acc, qk_scale, PRECISION)
    for start in range(lo + BLOCK_N, hi, BLOCK_N):
        k, v, nmask = _load_block(k_cache_ptr, v_cache_ptr, block_tables_ptr, b, stride_bt, kvh, start, hi, d,
                                  dmask, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, BLOCK_N)
        m_i, l_i, acc = attend_block(q, k, v, nmask, m_i, l_i, acc, qk_scale, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty split / seq_len 0: zeros
    out_mask = gmask[:, None] & dmask[None, :]
    out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    if NUM_SPLITS > 1:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + (b * NUM_KV_HEADS * GROUP + heads) * NUM_SPLITS + split, lse, mask=gmask)


@triton.jit
def _reduce_kernel(mid_ptr, lse_ptr, out_ptr, stride_ob, stride_oh,
                   NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)  # the partials come from the decode kernel just before
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < NUM_SPLITS
    base = (b * NUM_HEADS + h) * NUM_SPLITS
    lse = tl.load(lse_ptr + base + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights 0, output 0
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    mid = tl.load(mid_ptr + (base + s[:, None]) * HEAD_DIM + d[None, :],
                  mask=smask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(mid * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def decode_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_seq_len: int,
                      block_n: int = 64) -> int:
    """Splits per (sequence, KV head) so that a decode launch has about two programs per SM.

    Depends only on shapes, never on data, so that it is fixed for a captured batch size.
    """
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    wanted = triton.cdiv(2 * num_sms, programs)
    return max(1, min(MAX_SPLITS, wanted, triton.cdiv(max_seq_len, block_n)))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int = 0, num_splits: int = 1) -> torch.Tensor:
    """Store each sequence's new k/v [B, Hkv, D] at `slot_mapping` [B] (negative: skipped) in one
    layer's caches [num_pages, page_size, Hkv, D], and attend q [B, Hq, D] (the token at position
    `seq_lens[b] - 1`) over the sequence's keys; returns [B, Hq, D] in q's dtype.

    `block_tables` [B, W] int32, `seq_lens` [B] int32 (device; rows with 0 give zeros), `window` > 0
    keeps only the last `window` keys. Launch only: no host sync; grids depend on shapes and
    `num_splits` alone.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, cache_dim = k_cache.shape
    assert cache_dim == head_dim and num_heads % num_kv_heads == 0, (q.shape, k_cache.shape)
    assert k.shape == v.shape == (num_seqs, num_kv_heads, head_dim), (q.shape, k.shape, v.shape)
    assert block_tables.stride(1) == 1 and seq_lens.shape == slot_mapping.shape == (num_seqs,)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    group = num_heads // num_kv_heads
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    block_d = triton.next_power_of_2(head_dim)
    common = dict(NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
                  NUM_SPLITS=num_splits, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
                  BLOCK_N=64 if block_d <= 128 else 32,
                  PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PRELOAD=PRELOAD.on, num_warps=4,
                  **pdl_args(q.device))
    grid = (num_seqs, num_kv_heads, num_splits)
    inputs = (q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), block_tables.stride(0))
    qk_scale = scale * LOG2E
    if num_splits == 1:
        _decode_kernel[grid](*inputs, out, out, *strides, out.stride(0), out.stride(1), 0, qk_scale, window,
                             **common)
        return out
    mid = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[grid](*inputs, mid, lse, *strides, mid.stride(0), mid.stride(1), mid.stride(2), qk_scale, window,
                         **common)
    _reduce_kernel[(num_seqs, num_heads)](mid, lse, out, out.stride(0), out.stride(1),
                                          NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
                                          BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
                                          num_warps=1, **pdl_args(q.device))
    return out
