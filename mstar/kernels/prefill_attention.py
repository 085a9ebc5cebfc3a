"""Triton paged PREFILL / EXTEND attention over a packed (varlen) batch.

Each sequence's new query tokens (packed one sequence after another, [T, Hq, D]) attend over its
cached prefix plus themselves; the new tokens' K/V must already be in the cache. One program
handles (block of BLOCK_M query tokens, query head, sequence) and streams keys from the pages in
blocks of BLOCK_N with an online softmax in fp32. Causal or not; a sliding window applies to
causal attention only.

PDL (sm_90+, `mstar.kernels.pdl`): it lets the next kernel launch at its start and waits for the
previous one before its first load or store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels.decode_attention import LOG2E, kv_rows
from mstar.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, q_starts_ptr, seq_lens_ptr, out_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, qk_scale, window,
                    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)  # q, the cache and the index tensors are all written in the step
    mb = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(q_starts_ptr + b)
    q_len = tl.load(q_starts_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len

    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mmask = m < q_len
    dmask = d < HEAD_DIM
    q_pos = prefix + m
    q = tl.load(q_ptr + (q_start + m)[:, None].to(tl.int64) * stride_qt + h * stride_qh + d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    if CAUSAL:
        hi = tl.minimum(seq_len, prefix + (mb + 1) * BLOCK_M)
        lo = tl.where(window > 0, tl.maximum(prefix + mb * BLOCK_M - window + 1, 0), 0)
    else:
        hi = seq_len
        lo = 0
    hi = tl.where(mb * BLOCK_M < q_len, hi, lo)  # blocks past this sequence's queries do nothing

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n, nmask, row = kv_rows(block_tables_ptr, b, stride_bt, kvh, start, hi, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE,
                                BLOCK_N)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
        allowed = nmask[None, :]
        if CAUSAL:
            allowed = allowed & (n[None, :] <= q_pos[:, None])
            allowed = allowed & ((window <= 0) | (n[None, :] > q_pos[:, None] - window))
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep zeros, no NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + (q_start + m)[:, None].to(tl.int64) * stride_ot + h * stride_oh + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, q_starts: torch.Tensor, seq_lens: torch.Tensor,
                      max_query_len: int, scale: float, causal: bool = True, window: int = 0) -> torch.Tensor:
    """Varlen paged attention: q [T, Hq, D] packed by sequence (`q_starts` [B+1] int32 offsets into T),
    over one layer's caches [num_pages, page_size, Hkv, D]; returns [T, Hq, D] in q's dtype.

    Sequence b's queries sit at the last positions of its `seq_lens[b]` keys. `max_query_len` (a host
    int, an upper bound of the query lengths) sizes the grid; `window` > 0 applies to causal only.
    Launch only: no host sync.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, cache_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert cache_dim == head_dim and num_heads % num_kv_heads == 0, (q.shape, k_cache.shape)
    assert q_starts.shape == (num_seqs + 1,) and block_tables.stride(1) == 1
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    block = 64 if block_d <= 128 else 32
    grid = (triton.cdiv(max_query_len, block), num_heads, num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, q_starts, seq_lens, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        scale * LOG2E, window if causal else 0,
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        CAUSAL=causal, BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2,
        **pdl_args(q.device),
    )
    return out
