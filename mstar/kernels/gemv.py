"""Bandwidth-bound GEMV for a few rows (decode): y = x @ W.T (+ bias), and silu(gate) * up fused into x.

With M <= 4 rows a linear layer's whole cost is streaming W [N, K] (row-major) from HBM once. Each
program owns BLOCK_N rows of W and walks its slice of K in BLOCK_K-wide chunks: 16-byte loads along
K, elementwise fp32 multiply-adds into one [BLOCK_N, BLOCK_K] accumulator per row of x, and a single
reduction over K after the loop, so the loop holds only loads and FMAs (no shuffles, no barriers,
no layout conversions). At 4 rows those accumulators fill the registers; `fold_k` shrinks them by
summing groups of a thread's products every chunk. No tl.dot: at M <= 4 tensor cores buy nothing. BLOCK_K >= 8 * 32 * num_warps (bf16) lets every thread load its x slice once.

Programs must fill the GPU's SMs: BLOCK_N sets how many there are; where N is
too small, K is split. Split programs write fp32 partials to a workspace cached per shape; the last
of a tile's splits to finish (an atomic counter per tile says which) sums the partials in the fixed
order 0..SPLIT_K-1, adds the bias, stores the output and resets the counter. So one launch does it
all (no second reduce kernel), the result does not depend on which split finishes last (bit
reproducible), and it is CUDA-graph capturable (no host sync, no data-dependent allocation).

`gated=True` reads x as the [M, 2K] output of a gate_up projection and computes
silu(gate) * up in the x-load, rounded like `fused_ops.silu_and_mul`, which it replaces.

PDL (sm_90+, `mstar.kernels.pdl`): every program lets the next kernel launch at its start and loads
its first weight tile (weights are complete before a step starts) before `pdl_wait`; only after the
wait does it read x and the bias, store, or touch the split-K
workspace and counters. So a GEMV's blocks are resident, their first DRAM reads in flight, while the
previous kernel finishes.

Use through `mstar.kernels.skinny_gemm.skinny_linear` / `skinny_silu_and_mul_linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels.fused_ops import silu_times
from mstar.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait
from mstar.kernels.scratch import current_owner

MAX_M = 4  # rows above this take the tl.dot kernel in skinny_gemm


@triton.jit
def _load_x(x_ptrs, k, gate_offset, mask, GATED: tl.constexpr, EVEN_K: tl.constexpr):
    # x rows are tiny and shared by every program: they come from L2/L1, not HBM.
    if EVEN_K:
        x = tl.load(x_ptrs + k)
    else:
        x = tl.load(x_ptrs + k, mask=mask, other=0.0)
    if GATED:
        if EVEN_K:
            up = tl.load(x_ptrs + gate_offset + k)
        else:
            up = tl.load(x_ptrs + gate_offset + k, mask=mask, other=0.0)
        x = silu_times(x, up)  # rounded as fused_ops.silu_and_mul rounds
    return x.to(tl.float32)


@triton.jit
def load_chunk(ptrs, k, mask, EVEN_K: tl.constexpr):
    """The tile at `ptrs + k` of a walk over K: unmasked when the chunks divide K (EVEN_K), else zero
    where `mask` is false (the GEMV-style kernels here all load their K chunks through it)."""
    if EVEN_K:
        tile = tl.load(ptrs + k)
    else:
        tile = tl.load(ptrs + k, mask=mask, other=0.0)
    return tile


@triton.jit
def _folded(prod, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FOLD_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] products -> [BLOCK_N, BLOCK_K // FOLD_K]: groups of FOLD_K neighbouring products
    along K summed. With FOLD_K at most a thread's vector of K elements (8 for 16-byte bf16 loads) a group
    is one thread's registers, so the sum stays in the thread (`benchmarks/kernel_registers.py` shows the
    registers it frees). The reshape keeps the element order: with `can_reorder` the compiler may regroup
    elements across rows of N too, which sums other rows' products."""
    if FOLD_K > 1:
        prod = tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // FOLD_K, FOLD_K)), axis=2)
    return prod


@triton.jit
def _fma_rows(acc0, acc1, acc2, acc3, w, k, k_mask, x_ptrs, M, stride_xm, gate_offset, GATED: tl.constexpr,
              EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              FOLD_K: tl.constexpr):
    """acc_m += x[m, k:k + BLOCK_K] * w for the rows m of x (rows past M repeat row M - 1): one K chunk,
    folded by FOLD_K along K (`_folded`)."""
    w = w.to(tl.float32)
    acc0 += _folded(_load_x(x_ptrs, k, gate_offset, k_mask, GATED, EVEN_K) * w, BLOCK_N, BLOCK_K, FOLD_K)
    if BLOCK_M > 1:
        m = tl.minimum(1, M - 1)
        acc1 += _folded(_load_x(x_ptrs + m * stride_xm, k, gate_offset, k_mask, GATED, EVEN_K) * w,
                        BLOCK_N, BLOCK_K, FOLD_K)
    if BLOCK_M > 2:
        m = tl.minimum(2, M - 1)
        acc2 += _folded(_load_x(x_ptrs + m * stride_xm, k, gate_offset, k_mask, GATED, EVEN_K) * w,
                        BLOCK_N, BLOCK_K, FOLD_K)
        m = tl.minimum(3, M - 1)
        acc3 += _folded(_load_x(x_ptrs + m * stride_xm, k, gate_offset, k_mask, GATED, EVEN_K) * w,
                        BLOCK_N, BLOCK_K, FOLD_K)
    return acc0, acc1, acc2, acc3


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K, stride_xm, stride_wn, gate_offset,
                 HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                 K_ITERS: tl.constexpr, BROADCAST_X: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, FOLD_K: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    # Clamped indices keep the weight loads unmasked (vectorised); the extra rows are never stored.
    rn_safe = tl.minimum(rn, N - 1)
    w_ptrs = w_ptr + rn_safe[:, None] * stride_wn + rk[None, :]
    # The weight is constant during a step, so the first tile is loaded before the PDL wait: its DRAM
    # latency overlaps the previous kernel's tail. Everything else (x, every store,
    # the split-K workspace and counters) comes after the wait: the contract in mstar/kernels/pdl.py.
    k_start = pid_k * (K_ITERS * BLOCK_K)
    first_mask = ((k_start + rk) < K)[None, :]
    w_first = load_chunk(w_ptrs, k_start, first_mask, EVEN_K)
    pdl_wait(PDL)
    # x, w and the accumulators must share one register layout, or the compiler shuffles a tile through
    # shared memory every iteration. When BLOCK_K spans all warps (BROADCAST_X), a [1, BLOCK_K] x row
    # already has the weight tile's layout and is loaded once per thread; otherwise the warps split N
    # and x is read through pointers of the weight tile's shape (each row the same addresses, L1 hits).
    if BROADCAST_X:
        offs = rk[None, :]
    else:
        offs = (rn * 0)[:, None] + rk[None, :]
    x_ptrs = x_ptr + offs
    # One [BLOCK_N, BLOCK_K // FOLD_K] accumulator per row of x (rows past M repeat row M - 1, never stored).
    acc0 = tl.zeros((BLOCK_N, BLOCK_K // FOLD_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K // FOLD_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K // FOLD_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K // FOLD_K), dtype=tl.float32)
    acc0, acc1, acc2, acc3 = _fma_rows(acc0, acc1, acc2, acc3, w_first, k_start, first_mask, x_ptrs, M, stride_xm,
                                       gate_offset, GATED, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, FOLD_K)
    for i in range(1, K_ITERS):
        k = k_start + i * BLOCK_K
        k_mask = ((k + rk) < K)[None, :]
        w = load_chunk(w_ptrs, k, k_mask, EVEN_K)
        acc0, acc1, acc2, acc3 = _fma_rows(acc0, acc1, acc2, acc3, w, k, k_mask, x_ptrs, M, stride_xm, gate_offset,
                                           GATED, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, FOLD_K)
    # The only cross-thread reductions, once per row after the loop; rows gathered into [BLOCK_M, BLOCK_N].
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + tl.sum(acc0, axis=1)[None, :]
    if BLOCK_M > 1:
        part = tl.where(rm[:, None] == 1, tl.sum(acc1, axis=1)[None, :], part)
    if BLOCK_M > 2:
        part = tl.where(rm[:, None] == 2, tl.sum(acc2, axis=1)[None, :], part)
        part = tl.where(rm[:, None] == 3, tl.sum(acc3, axis=1)[None, :], part)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out_ptrs = out_ptr + rm[:, None] * N + rn[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            part += tl.load(b_ptr + rn_safe).to(tl.float32)[None, :]
        tl.store(out_ptrs, part.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tile = rm[:, None] * N + rn[None, :]
        tl.store(ws_ptr + pid_k * M * N + tile, part, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last split of this tile: sum all partials in a fixed order
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(ws_ptr + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rn_safe).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch


_BUFFERS: dict[tuple[str, torch.device, int, object], torch.Tensor] = {}


def _buffer(kind: str, device: torch.device, numel: int) -> torch.Tensor:
    # Allocated the first time a shape is seen (warm-up), then reused, so graph replays keep pointing at
    # it; launches on one stream use it one after another (an engine on a stream of its own has its
    # own: `scratch.py`). Counters start at zero and every launch leaves them at zero.
    key = (kind, device, numel, current_owner())
    buf = _BUFFERS.get(key)
    if buf is None:
        dtype = torch.float32 if kind == "ws" else torch.int32
        buf = _BUFFERS[key] = torch.zeros(numel, dtype=dtype, device=device)
    return buf


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_m: int, block_n: int,
         block_k: int, split_k: int = 1, num_warps: int = 4, num_stages: int = 2,
         gated: bool = False, fold_k: int = 1) -> torch.Tensor:
    """x [M, K] (or [M, 2K] = [gate | up] when `gated`) times weight [N, K].T (+ bias) -> [M, N].

    M <= block_m <= MAX_M. Output in x's dtype, accumulated in fp32, bit-reproducible; inputs are
    checked by the caller (`skinny_gemm`). `split_k` is an upper bound: each split keeps whole
    BLOCK_K chunks. `fold_k` (`SkinnyConfig` checks it) sums
    groups of that many products along K inside each thread every chunk, so the accumulators take
    fold_k times fewer registers (more rows of x per program at the same register budget).
    """
    m = x.shape[0]
    n, k = weight.shape
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # rounding k_per_split up can leave fewer splits
    tiles = triton.cdiv(n, block_n)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = _buffer("ws", x.device, split * m * n) if split > 1 else out
    lock = _buffer("lock", x.device, tiles) if split > 1 else out
    _gemv_kernel[(tiles, split)](
        x, weight, bias if bias is not None else weight, out, ws, lock, m, n, k, x.stride(0), weight.stride(0), k,
        HAS_BIAS=bias is not None, GATED=gated, SPLIT_K=split, EVEN_K=split * k_per_split == k,
        K_ITERS=k_per_split // block_k,
        BROADCAST_X=block_k >= 16 // x.element_size() * 32 * num_warps,  # 16-byte loads by every thread
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FOLD_K=fold_k, num_warps=num_warps,
        num_stages=num_stages,
        **pdl_args(x.device),
    )
    return out
