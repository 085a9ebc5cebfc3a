"""Skinny GEMM (decode GEMV): y = x @ W.T (+ bias) for few rows of x, reading the weight once.

At decode, a linear layer's cost is reading its weight [N, K]; cuBLAS picks split-K kernels plus a
separate reduce for some shapes and leaves bandwidth unused. Here each program owns BLOCK_N weight
rows, streams its slice of K in wide chunks and keeps every row of x (M <= 64) in-program, with
fp32 accumulation. For M <= 4 the product is a broadcast-multiply and sum (no padding); above, a
`tl.dot` with M padded to 16/32/64.

When N / BLOCK_N gives too few programs to fill the GPU, K is split: each split writes an fp32
partial into a workspace cached per shape, and a second kernel sums the partials in a fixed order
(no atomics: results are reproducible and the pair is CUDA-graph capturable; no host syncs, no
data-dependent allocation).

Block sizes come from `pick_config` (a static heuristic; `TUNED` overrides per (M bucket, N, K),
filled from `benchmarks/gemv_micro.py --sweep`). Use through `mstar.layers.linear.linear`, which
decides per shape whether this beats F.linear; tests run it on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_M = 64  # the largest row count the kernel handles (block_m <= 64)


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch parameters of one skinny GEMM: tile sizes, K splits, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    @property
    def use_dot(self) -> bool:
        """tl.dot needs at least 16 rows; fewer rows use the broadcast-multiply path."""
        return self.block_m >= 16


# (M bucket, N, K) -> config measured best on the target GPU; consulted before the heuristic.
TUNED: dict[tuple[int, int, int], SkinnyConfig] = {}


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, M, N, K, stride_xm, stride_wn,
                   HAS_BIAS: tl.constexpr, TO_WORKSPACE: tl.constexpr, USE_DOT: tl.constexpr,
                   EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, K_ITERS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    # Clamped row indices keep the hot loads unmasked (vectorised); the extra rows are never stored.
    rn_safe = tl.minimum(rn, N - 1)
    rm_safe = tl.minimum(rm, M - 1)
    w_ptrs = w_ptr + rn_safe[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm_safe[:, None] * stride_xm + rk[None, :]
    k_start = pid_k * (K_ITERS * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Every split runs the same (compile-time) count of K blocks; only the last may run past K (masked
    # unless EVEN_K). A constexpr trip count also lets the compiler unroll and pipeline the loads.
    for i in range(K_ITERS):
        k = k_start + i * BLOCK_K
        if EVEN_K:
            w = tl.load(w_ptrs + k)
            x = tl.load(x_ptrs + k)
        else:
            k_mask = (k + rk) < K
            w = tl.load(w_ptrs + k, mask=k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs + k, mask=k_mask[None, :], other=0.0)
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if TO_WORKSPACE:
        tl.store(ws_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn_safe).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, b_ptr, out_ptr, total, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # fixed order: the sum is the same on every run
        acc += tl.load(ws_ptr + s * total + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_SM_COUNT: dict[int, int] = {}
_WORKSPACES: dict[tuple[torch.device, int], torch.Tensor] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter: pretend an H100/H200 so the split-K path is exercised the same way
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def m_bucket(m: int) -> int:
    """The power of two (1..64) that rows-count `m` is grouped under for configs and decisions."""
    return 1 << max(m - 1, 0).bit_length()


def pick_config(m: int, n: int, k: int, sm_count: int = 132) -> SkinnyConfig:
    """The launch config for x [m, k] @ W[n, k].T: `TUNED` if listed, else a static heuristic."""
    bucket = m_bucket(m)
    tuned = TUNED.get((bucket, n, k))
    if tuned is not None:
        return tuned
    if bucket <= 4:
        # Broadcast path: the [M, BLOCK_N, BLOCK_K] product lives in registers; keep it ~8K elements.
        block_m, block_n, block_k, warps, stages = bucket, 16, max(512 // bucket, 128), 4, 3
    else:
        block_m = max(bucket, 16)
        block_n, block_k = 32, 256 if block_m <= 16 else 128
        warps, stages = 4, 4
    return SkinnyConfig(block_m, block_n, block_k, _pick_split(n, k, block_n, block_k, sm_count), warps, stages)


def _pick_split(n: int, k: int, block_n: int, block_k: int, sm_count: int) -> int:
    # Aim for >= 4 programs per SM so the last wave is short; every split keeps >= one full K block.
    programs, split = triton.cdiv(n, block_n), 1
    while programs * split < 4 * sm_count and split < 16 and k // (split * 2) >= block_k:
        split *= 2
    return split


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    # One fp32 buffer per (device, size): allocated the first time a shape is seen (warm-up), then reused,
    # so graph replays keep pointing at it. Launches on one stream use it one after another.
    key = (device, numel)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = torch.empty(numel, dtype=torch.float32, device=device)
    return ws


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T + bias -> [M, N] in x's dtype, accumulated in fp32; M <= MAX_M.

    x and weight need the same dtype (bf16, fp16 or fp32) and unit stride along K. Deterministic:
    the same inputs give the same bits on every call. `config` overrides `pick_config` (benchmarks).
    """
    m, k = x.shape
    n = weight.shape[0]
    if m < 1 or m > MAX_M:
        raise ValueError(f"skinny_linear handles 1..{MAX_M} rows, got x of shape {tuple(x.shape)}; use F.linear")
    if weight.shape[1] != k or x.dtype != weight.dtype or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear needs x [M, K] and weight [N, K] of one dtype with unit K stride, got "
                         f"x {tuple(x.shape)} {x.dtype} stride {x.stride()}, weight {tuple(weight.shape)} "
                         f"{weight.dtype} stride {weight.stride()}")
    cfg = config or pick_config(m, n, k, _sm_count(x.device))
    if cfg.block_m < m:
        raise ValueError(f"config block_m={cfg.block_m} is smaller than M={m}")
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # rounding k_per_split up can leave fewer splits
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = _workspace(x.device, split * m * n) if split > 1 else out
    has_bias = bias is not None
    _skinny_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, weight, bias if has_bias else weight, out, ws, m, n, k, x.stride(0), weight.stride(0),
        HAS_BIAS=has_bias, TO_WORKSPACE=split > 1, USE_DOT=cfg.use_dot, EVEN_K=split * k_per_split == k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", K_ITERS=k_per_split // cfg.block_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            ws, bias if has_bias else ws, out, m * n, n, SPLIT=split, HAS_BIAS=has_bias, BLOCK=block,
        )
    return out
