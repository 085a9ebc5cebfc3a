"""Skinny GEMM with FP8 weights (decode): y = x @ (q * s).T (+ bias) for few rows of x, reading q once.

At decode a linear layer's cost is streaming its weight from HBM; an E4M3 weight (`layers/fp8.py`) is
one byte an element, half of bf16, so a kernel that reads it as it is and never writes a dequantized
copy halves that cost. q is float8_e4m3fn [N, K] with float32 scales s, either one per output channel
([N, 1]) or one per (SCALE_BN x SCALE_BK) block; x is bf16 or fp16; products accumulate in fp32 and
the output has x's dtype. E4M3 -> fp32 (and -> bf16/fp16 for tl.dot) is exact, so the only roundings
are fp32 arithmetic and the final one to x's dtype: within a rounding of `weight_only_linear`, which
rounds q * s to x's dtype first.

Two kernels:

- M <= 4 (`_fp8_gemv_kernel`, modelled on `mstar.kernels.gemv`): the GEMV. Each program owns BLOCK_N
  rows of q and walks K in BLOCK_K chunks with 8-byte loads (8 E4M3 values a thread, so that the weight
  tile has the register layout of x's 16-byte loads and no tile is shuffled through shared memory in
  the loop; `benchmarks/kernel_registers.py --fp8` shows it), multiply-adds into one fp32 accumulator
  per row of x (`gemv._fma_rows`, folded along K by FOLD_K), and reduces over K once after the loop.
  With `gated` it reads x as a gate_up projection's [M, 2K] output and takes silu(gate) * up in the
  x-load, as gemv.py does, for a down projection without the SiLU launch.
- configs with block_m >= 16: the skinny GEMM's tl.dot kernel (`skinny_gemm.dot_linear`), x padded to
  16, 32 or 64 rows against the chunk of q converted to x's dtype (exact); under the Triton interpreter
  (CPU tensors, tests) the operands are fp32, since numpy has no bf16 matmul.

Scales: per channel, s[n] multiplies the finished sum of row n (one multiply an output; of each split's
sum where K is split). Blocks: every chunk lies inside one block column (BLOCK_K divides SCALE_BK,
checked), so the chunk's products are scaled by s[n // SCALE_BN, k // SCALE_BK] before they are added.

Two config pickers for the tl.dot kernel, both candidates of the per-shape timing in `layers.linear`:
`pick_fp8_config` (from 5 rows, no split-K: BLOCK_N narrow enough for the programs to fill the SMs at the
decoder shapes, N >= 3072) and `pick_skinny_config` (`fp8_skinny_linear`, from 1 row: the bf16 skinny
GEMM's tuned configs and heuristic, K split into an fp32 workspace summed in a fixed order where N gives
too few programs). Either way no host sync, bit-reproducible and CUDA-graph capturable.

PDL (sm_90+, `mstar.kernels.pdl`): the GEMV loads its first weight tile before `pdl_wait`, as
`gemv.py` does; the tl.dot kernel waits first.

Use through `mstar.layers.fp8.fp8_linear` and `mstar.layers.linear.linear`, which send CUDA inputs of at
most MAX_M rows here (`linear` times this module's kernels, and `torch._scaled_mm` from 16 rows, per shape).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from mstar.kernels.gemv import _fma_rows, load_chunk
from mstar.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait
from mstar.kernels.skinny_gemm import SkinnyConfig, block_scale, dot_linear, m_bucket, pick_config

MAX_M = 64  # rows above this: torch._scaled_mm or the weight-only reference (layers/fp8.py)
GEMV_MAX_M = 4  # rows up to this take the GEMV, more the tl.dot kernel
_X_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _fma_chunk(acc0, acc1, acc2, acc3, w, s_ptr, rn_safe, k, k_mask, x_ptrs, M, stride_xm, stride_sn, gate_offset,
               GATED: tl.constexpr, BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, EVEN_K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FOLD_K: tl.constexpr):
    """acc_m += x[m, k:k + BLOCK_K] * w for each row m of x (`gemv._fma_rows`), w scaled first when the
    scales are blocks."""
    w = w.to(tl.float32)
    if BLOCK_SCALES:
        w = w * block_scale(s_ptr, rn_safe, k, stride_sn, SCALE_BN, SCALE_BK)[:, None]
    return _fma_rows(acc0, acc1, acc2, acc3, w, k, k_mask, x_ptrs, M, stride_xm, gate_offset, GATED, EVEN_K, BLOCK_M,
                     BLOCK_N, BLOCK_K, FOLD_K)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, gate_offset,
                     GATED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr,
                     SCALE_BK: tl.constexpr, EVEN_K: tl.constexpr, K_ITERS: tl.constexpr,
                     BROADCAST_X: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, FOLD_K: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    # Clamped indices keep the weight loads unmasked (vectorised); the extra rows are never stored.
    rn_safe = tl.minimum(rn, N - 1)
    # The same offsets as rk, written so that the compiler sees runs of only 8 contiguous bytes: 8-byte weight
    # loads give the weight tile the layout of x's 16-byte loads (8 bf16 values), so no tile is shuffled
    # through shared memory to meet the other's layout in the loop.
    rk_w = (rk // 8) * 8 + rk % 8
    w_ptrs = w_ptr + rn_safe[:, None] * stride_wn + rk_w[None, :]
    # Weights and scales are constant during a step: the first tile may load before the PDL wait.
    first_mask = (rk < K)[None, :]
    w_first = load_chunk(w_ptrs, 0, first_mask, EVEN_K)
    pdl_wait(PDL)
    # x must share the weight tile's register layout (gemv.py says why); BLOCK_K spanning every thread's
    # 8 values lets a [1, BLOCK_K] x row have it.
    if BROADCAST_X:
        offs = rk[None, :]
    else:
        offs = (rn * 0)[:, None] + rk[None, :]
    x_ptrs = x_ptr + offs
    acc0 = tl.zeros((BLOCK_N, BLOCK_K // FOLD_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K // FOLD_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K // FOLD_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K // FOLD_K), dtype=tl.float32)
    acc0, acc1, acc2, acc3 = _fma_chunk(acc0, acc1, acc2, acc3, w_first, s_ptr, rn_safe, 0, first_mask, x_ptrs, M,
                                        stride_xm, stride_sn, gate_offset, GATED, BLOCK_SCALES, SCALE_BN, SCALE_BK,
                                        EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, FOLD_K)
    for i in range(1, K_ITERS):
        k = i * BLOCK_K
        k_mask = ((k + rk) < K)[None, :]
        w = load_chunk(w_ptrs, k, k_mask, EVEN_K)
        acc0, acc1, acc2, acc3 = _fma_chunk(acc0, acc1, acc2, acc3, w, s_ptr, rn_safe, k, k_mask, x_ptrs, M,
                                            stride_xm, stride_sn, gate_offset, GATED, BLOCK_SCALES, SCALE_BN, SCALE_BK,
                                            EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, FOLD_K)
    # One cross-thread reduction per row after the loop; rows gathered into [BLOCK_M, BLOCK_N].
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + tl.sum(acc0, axis=1)[None, :]
    if BLOCK_M > 1:
        part = tl.where(rm[:, None] == 1, tl.sum(acc1, axis=1)[None, :], part)
    if BLOCK_M > 2:
        part = tl.where(rm[:, None] == 2, tl.sum(acc2, axis=1)[None, :], part)
        part = tl.where(rm[:, None] == 3, tl.sum(acc3, axis=1)[None, :], part)
    if not BLOCK_SCALES:
        part = part * tl.load(s_ptr + rn_safe * stride_sn)[None, :]
    if HAS_BIAS:
        part += tl.load(b_ptr + rn_safe).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], part.to(out_ptr.dtype.element_ty), mask=mask)


def pick_fp8_config(m: int, n: int, k: int, block: tuple[int, int] | None, sm_count: int = 132) -> SkinnyConfig:
    """The launch config for x [m, k] @ q[n, k].T with scales of `block` (None: per channel); split_k is 1."""
    bucket = m_bucket(m)
    if bucket > GEMV_MAX_M:
        # Every program re-reads x from L2: wider tiles of q for more rows, while programs fill the SMs.
        block_m = max(bucket, 16)
        block_n = 16 if block_m == 16 or triton.cdiv(n, 64) < sm_count else 64
        block_k = 128 if block is None else _block_chunk(block)
        return SkinnyConfig(block_m, block_n, block_k, num_warps=4, num_stages=4 if block_m <= 32 else 3)
    # 8 E4M3 values of a row a thread: BLOCK_K = 1024 spans 4 warps, so x is loaded once per thread; 4 rows
    # of q a program keep the accumulators at 64-80 registers (folded beyond one row of x: 8 blocks an SM).
    # Block scales: one block column a chunk.
    block_k = min(1024, triton.next_power_of_2(k)) if block is None else _block_chunk(block)
    block_n = 4 if block is None else 16
    while block_n > 1 and triton.cdiv(n, block_n) < 2 * sm_count:
        block_n //= 2
    return SkinnyConfig(bucket, block_n, block_k, num_warps=4, num_stages=2 if block is None else 3,
                        fold_k=1 if bucket == 1 else 8)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter: a large GPU's count, so configs are picked as they are served
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block_chunk(block: tuple[int, int]) -> int:
    """The widest power-of-two chunk (<= 128) that divides the scale block's columns."""
    return min(128, block[1] & -block[1])


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
           cfg: SkinnyConfig, gated: bool) -> None:
    m = x.shape[0]
    n, k = weight.shape
    max_m = GEMV_MAX_M if gated else MAX_M
    if x.dim() != 2 or not 1 <= m <= max_m or x.dtype not in _X_DTYPES or x.stride(1) != 1:
        raise ValueError(f"fp8_gemv handles 1..{max_m} rows of bf16/fp16 x with unit K stride, got x "
                         f"{tuple(x.shape)} {x.dtype} stride {x.stride()}; use layers.fp8.weight_only_linear")
    if weight.dtype != torch.float8_e4m3fn or x.shape[1] != (2 if gated else 1) * k or weight.stride(1) != 1:
        raise ValueError(f"fp8_gemv needs a float8_e4m3fn weight [N, K] with unit K stride and x of width "
                         f"{'2K' if gated else 'K'}, got x {tuple(x.shape)}, weight {tuple(weight.shape)} "
                         f"{weight.dtype} stride {weight.stride()}")
    want = (n, 1) if block is None else (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want or not scale.is_contiguous():
        raise ValueError(f"fp8_gemv needs contiguous float32 scales of shape {want}, got {tuple(scale.shape)} "
                         f"{scale.dtype} stride {scale.stride()}")
    if (cfg.split_k != 1 and not cfg.use_dot) or cfg.block_m < m or (gated and cfg.use_dot):
        raise ValueError(f"fp8_gemv config {cfg}: needs block_m >= M={m}, split_k=1 on the GEMV (block_m <= "
                         f"{GEMV_MAX_M}) and, gated, the GEMV")
    if block is not None and block[1] % cfg.block_k:
        raise ValueError(f"fp8_gemv config block_k={cfg.block_k} must divide the scale block's {block[1]} columns")


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             block: tuple[int, int] | None, config: SkinnyConfig | None = None, gated: bool = False) -> torch.Tensor:
    """x [M, K] @ (weight * scale)[N, K].T + bias -> [M, N] in x's dtype, accumulated in fp32.

    weight float8_e4m3fn; scale float32 [N, 1] (block None) or [ceil(N/bn), ceil(K/bk)] for block
    (bn, bk); x bf16 or fp16 with 1..MAX_M rows. `gated`: x is [M, 2K] = [gate | up] of a gate_up
    projection (M <= GEMV_MAX_M) and the product is taken with silu(gate) * up, rounded as
    `fused_ops.silu_and_mul` rounds, in place of x. Deterministic. `config` overrides `pick_fp8_config`.
    """
    m = x.shape[0]
    n, k = weight.shape
    cfg = config or pick_fp8_config(m, n, k, block, _sm_count(x.device))
    _check(x, weight, scale, block, cfg, gated)
    if cfg.use_dot:
        return dot_linear(x, weight, bias, cfg, scale, block)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    scale_bn, scale_bk = block or (1, 1)
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, scale, bias if bias is not None else scale, out, m, n, k, x.stride(0), weight.stride(0),
        scale.stride(0), k, GATED=gated, HAS_BIAS=bias is not None, BLOCK_SCALES=block is not None,
        SCALE_BN=scale_bn, SCALE_BK=scale_bk, EVEN_K=k % cfg.block_k == 0, K_ITERS=triton.cdiv(k, cfg.block_k),
        BROADCAST_X=cfg.block_k >= 8 * 32 * cfg.num_warps, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, FOLD_K=cfg.fold_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(x.device))
    return out


def pick_skinny_config(m: int, n: int, k: int, block: tuple[int, int] | None, sm_count: int = 132) -> SkinnyConfig:
    """The bf16 skinny GEMM's tl.dot config for x [m, k] @ q[n, k].T (`skinny_gemm.pick_config`: its tuned
    table, else its heuristic, K split where N leaves too few programs), the 8-row one for m <= 4 (a 16-row
    tile), with BLOCK_K narrowed to one scale block column for block scales."""
    cfg = pick_config(max(m, GEMV_MAX_M + 1), n, k, sm_count)
    if block is not None and block[1] % cfg.block_k:
        cfg = dataclasses.replace(cfg, block_k=_block_chunk(block))
    return cfg


def fp8_skinny_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                      block: tuple[int, int] | None) -> torch.Tensor:
    """`fp8_gemv` through the skinny GEMM's tl.dot kernel at the bf16 configs (`pick_skinny_config`) for
    1..MAX_M rows: weight-only, the same numerics, K split where N gives too few programs."""
    m = x.shape[0]
    n, k = weight.shape
    return fp8_gemv(x, weight, scale, bias, block, config=pick_skinny_config(m, n, k, block, _sm_count(x.device)))
