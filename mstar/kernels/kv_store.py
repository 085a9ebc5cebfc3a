"""Triton kernel writing the new tokens' K/V rows into a paged cache by flat slot.

PDL (sm_90+, `mstar.kernels.pdl`): it lets the next kernel launch at its start and waits for the
previous one before its first load or store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)  # k/v and the slots come from earlier kernels
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM) & (slot >= 0)  # slot < 0: padding row, write nothing
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = slot * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] into one layer's caches [num_pages, page_size, Hkv, D] at `slot_mapping` [T]
    (flat slot = page * page_size + offset); rows whose slot is negative are skipped.

    Launch only: no host sync, grid = T. k/v may be strided views (last dim contiguous); values are
    cast to the cache dtype.
    """
    num_tokens, num_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,), (k.shape, v.shape, slot_mapping.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape[-2:] == (num_heads, head_dim), (k_cache.shape, k.shape)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4, **pdl_args(k.device),
    )
