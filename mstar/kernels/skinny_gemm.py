"""Skinny GEMM (decode GEMV): y = x @ W.T (+ bias) for few rows of x, reading the weight once.

At decode, a linear layer's cost is reading its weight [N, K]; cuBLAS picks split-K kernels plus a
separate reduce for some shapes and leaves bandwidth unused. Two kernels serve here, both with fp32
accumulation, both deterministic and CUDA-graph capturable (no host syncs, no data-dependent
allocation; workspaces cached per shape):

- block_m <= 4 (`mstar.kernels.gemv`): a pure-bandwidth GEMV, no tl.dot, wide loads along K, one
  reduction after the K loop, split-K finished inside the same launch. It also serves
  `skinny_silu_and_mul_linear`, the down projection with SiLU-and-mul fused into its x-load.
- block_m >= 16: each program owns BLOCK_N weight rows and keeps every row of x (M <= 64, padded to
  16/32/64) in a `tl.dot`; when N / BLOCK_N gives too few programs, K is split, fp32 partials go to a
  workspace and a second kernel sums them in a fixed order (no atomics). The same kernel takes E4M3
  weights with per-channel or block scales (`dot_linear`'s `scale`; used by `mstar.kernels.fp8_gemv`):
  each chunk is converted to x's dtype in registers (exact), products sum in fp32 and the scales are
  applied to the sums, so FP8 weights are read at one byte an element and no activation is quantized.

Block sizes come from `pick_config` (a static heuristic; `TUNED` overrides per (M bucket, N, K),
filled from `benchmarks/gemv_micro.py --sweep`, which times candidates inside CUDA graphs).
Use through `mstar.layers.linear`, which decides per shape whether this beats F.linear; tests run it on
CPU with TRITON_INTERPRET=1.

PDL (sm_90+, `mstar.kernels.pdl`): both tl.dot-path kernels let the next kernel launch at their
start and wait for the previous one before any load or store; the GEMV path keeps the same contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mstar.kernels.gemv import MAX_M as GEMV_MAX_M
from mstar.kernels.gemv import gemv, load_chunk
from mstar.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait
from mstar.kernels.scratch import current_owner

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
    fold_k: int = 1  # GEMV only: groups of K products summed inside each thread every chunk (kernels.gemv)

    @property
    def use_dot(self) -> bool:
        """tl.dot needs at least 16 rows; block_m <= 4 runs the GEMV kernel (`mstar.kernels.gemv`)."""
        return self.block_m >= 16

    def __post_init__(self) -> None:
        if self.block_m not in (1, 2, 4, 16, 32, 64):
            raise ValueError(f"block_m={self.block_m}: use 1, 2 or 4 (GEMV kernel) or 16, 32, 64 (tl.dot kernel)")
        if self.fold_k not in (1, 2, 4, 8) or self.block_k % self.fold_k or (self.use_dot and self.fold_k != 1):
            raise ValueError(f"fold_k={self.fold_k}: use 1, 2, 4 or 8, dividing block_k={self.block_k}; the tl.dot "
                             "kernel (block_m >= 16) takes only 1")


# (M bucket, N, K) -> the config `benchmarks/gemv_micro.py --sweep` found best for the Orpheus-3B /
# Llama-3.2-3B decode shapes in bf16 (its result files name the GPU); consulted before the heuristic,
# which serves every other shape.
TUNED: dict[tuple[int, int, int], SkinnyConfig] = {
    (1, 5120, 3072): SkinnyConfig(block_m=1, block_n=2, block_k=1024, split_k=1, num_warps=4, num_stages=3),
    (8, 5120, 3072): SkinnyConfig(block_m=16, block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=3),
    (16, 5120, 3072): SkinnyConfig(block_m=16, block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=3),
    (1, 3072, 3072): SkinnyConfig(block_m=1, block_n=1, block_k=1024, split_k=1, num_warps=2, num_stages=3),
    (8, 3072, 3072): SkinnyConfig(block_m=16, block_n=32, block_k=128, split_k=4, num_warps=4, num_stages=4),
    (16, 3072, 3072): SkinnyConfig(block_m=16, block_n=32, block_k=128, split_k=4, num_warps=4, num_stages=4),
    (1, 16384, 3072): SkinnyConfig(block_m=1, block_n=2, block_k=2048, split_k=1, num_warps=8, num_stages=3),
    (8, 16384, 3072): SkinnyConfig(block_m=16, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    (16, 16384, 3072): SkinnyConfig(block_m=16, block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=4),
    (8, 3072, 8192): SkinnyConfig(block_m=16, block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4),
    (16, 3072, 8192): SkinnyConfig(block_m=16, block_n=32, block_k=256, split_k=4, num_warps=4, num_stages=3),
    (1, 156940, 3072): SkinnyConfig(block_m=1, block_n=2, block_k=1024, split_k=1, num_warps=4, num_stages=1),
    (8, 156940, 3072): SkinnyConfig(block_m=16, block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=4),
    (16, 156940, 3072): SkinnyConfig(block_m=16, block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=4),
    # M = 2 and 4: the winners of the sweep over fold_k (tests/gpu/test_gemv_gpu.py checks each against F.linear)
    (2, 5120, 3072): SkinnyConfig(block_m=2, block_n=4, block_k=1024, split_k=1, num_warps=4, num_stages=3, fold_k=1),
    (4, 5120, 3072): SkinnyConfig(block_m=4, block_n=4, block_k=512, split_k=1, num_warps=2, num_stages=2, fold_k=8),
    (2, 3072, 3072): SkinnyConfig(block_m=2, block_n=4, block_k=1024, split_k=1, num_warps=4, num_stages=1, fold_k=8),
    (4, 3072, 3072): SkinnyConfig(block_m=4, block_n=2, block_k=1024, split_k=1, num_warps=4, num_stages=1, fold_k=8),
    (2, 16384, 3072): SkinnyConfig(block_m=2, block_n=4, block_k=1024, split_k=1, num_warps=4, num_stages=1),
    (4, 16384, 3072): SkinnyConfig(block_m=4, block_n=8, block_k=1024, split_k=1, num_warps=4, num_stages=3, fold_k=8),
    (2, 3072, 8192): SkinnyConfig(block_m=2, block_n=2, block_k=1024, split_k=1, num_warps=2, num_stages=1, fold_k=8),
    (4, 3072, 8192): SkinnyConfig(block_m=4, block_n=8, block_k=1024, split_k=1, num_warps=4, num_stages=3, fold_k=8),
    # qkv at M = 4 from the sweep that also tries the tl.dot kernel at M <= 4 (gate_up keeps the entry
    # above: the GEMV path at M <= 4 never takes tl.dot). Then Orpheus' speakable head rows.
    (1, 28680, 3072): SkinnyConfig(block_m=1, block_n=2, block_k=1024, split_k=1, num_warps=2, num_stages=2),
    (2, 28680, 3072): SkinnyConfig(block_m=2, block_n=4, block_k=1024, split_k=1, num_warps=4, num_stages=1, fold_k=1),
    (4, 28680, 3072): SkinnyConfig(block_m=4, block_n=8, block_k=1024, split_k=1, num_warps=4, num_stages=2, fold_k=8),
    (8, 28680, 3072): SkinnyConfig(block_m=16, block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3),
    (16, 28680, 3072): SkinnyConfig(block_m=16, block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3),
}
# The same for skinny_silu_and_mul_linear, keyed by (M bucket, N, I) of the down projection.
TUNED_SILU_DOWN: dict[tuple[int, int, int], SkinnyConfig] = {
    (1, 3072, 8192): SkinnyConfig(block_m=1, block_n=8, block_k=1024, split_k=1, num_warps=4, num_stages=2),
    (2, 3072, 8192): SkinnyConfig(block_m=2, block_n=4, block_k=2048, split_k=1, num_warps=8, num_stages=2, fold_k=8),
    (4, 3072, 8192): SkinnyConfig(block_m=4, block_n=16, block_k=1024, split_k=1, num_warps=4, num_stages=2, fold_k=8),
}


@triton.jit
def block_scale(s_ptr, rn_safe, k, stride_sn, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr):
    """[BLOCK_N] scales of the K chunk starting at k, for E4M3 weights with block scales (the whole chunk
    lies in one block column)."""
    return tl.load(s_ptr + (rn_safe // SCALE_BN) * stride_sn + k // SCALE_BK)


@triton.jit
def _dot_chunk(x, w, DOT_FP32: tl.constexpr):
    """x @ w.T of one K chunk in fp32; w (x's dtype, or E4M3) is converted to x's dtype, which is exact."""
    if DOT_FP32:  # float32 inputs, and the interpreter (numpy has no bfloat16 matmul)
        prod = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        prod = tl.dot(x, tl.trans(w.to(x.dtype)))
    return prod


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                   HAS_BIAS: tl.constexpr, TO_WORKSPACE: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
                   SCALES: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, K_ITERS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)  # everything below reads x or writes: after the previous kernel (mstar/kernels/pdl.py)
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
        k_mask = ((k + rk) < K)[None, :]
        w = load_chunk(w_ptrs, k, k_mask, EVEN_K)
        x = load_chunk(x_ptrs, k, k_mask, EVEN_K)
        if SCALES == "block":  # a chunk wholly past K (last split) reads the last block column, not past it
            acc += _dot_chunk(x, w, DOT_FP32) * block_scale(s_ptr, rn_safe, tl.minimum(k, K - 1), stride_sn, SCALE_BN,
                                                            SCALE_BK)[None, :]
        else:
            acc += _dot_chunk(x, w, DOT_FP32)
    if SCALES == "channel":  # linear in the sum, so each split's partial is scaled before it is stored
        acc = acc * tl.load(s_ptr + rn_safe * stride_sn)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if TO_WORKSPACE:
        tl.store(ws_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn_safe).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, b_ptr, out_ptr, total, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)  # the partials come from the kernel just before
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # fixed order: the sum is the same on every run
        acc += tl.load(ws_ptr + s * total + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_SM_COUNT: dict[int, int] = {}
_WORKSPACES: dict[tuple[torch.device, int, object], torch.Tensor] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter: a large GPU's SM count, so the split-K path is exercised as it is served
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
        return _gemv_config(bucket, n, k, sm_count)
    block_m = max(bucket, 16)
    block_n, block_k = 32, 256 if block_m <= 16 else 128
    return SkinnyConfig(block_m, block_n, block_k, _pick_split(n, k, block_n, block_k, 4 * sm_count), 4, 4)


def _gemv_config(bucket: int, n: int, k: int, sm_count: int) -> SkinnyConfig:
    # BLOCK_K = 1024 spans all 4 warps with 16-byte loads (bf16; 2 loads per row for fp32), so x is read
    # once per thread. Each program re-reads its x slice (L1 hits) per BLOCK_N weight rows: BLOCK_N >= 2
    # keeps that traffic <= 2x the weight's, while the fp32 accumulators stay at <= 64 registers.
    block_k = min(1024, triton.next_power_of_2(k))
    block_n = 4 if bucket == 1 else 2
    return SkinnyConfig(bucket, block_n, block_k, _pick_split(n, k, block_n, block_k, 2 * sm_count), 4, 2)


def _pick_split(n: int, k: int, block_n: int, block_k: int, min_programs: int) -> int:
    # Split K until there are min_programs programs; every split keeps >= one full K block.
    programs, split = triton.cdiv(n, block_n), 1
    while programs * split < min_programs and split < 16 and k // (split * 2) >= block_k:
        split *= 2
    return split


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    # One fp32 buffer per (device, size, owner): allocated the first time a shape is seen (warm-up), then
    # reused, so graph replays keep pointing at it. Launches on one stream use it one after another (an
    # engine on a stream of its own has its own: `scratch.py`).
    key = (device, numel, current_owner())
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = torch.empty(numel, dtype=torch.float32, device=device)
    return ws


def _check(x: torch.Tensor, weight: torch.Tensor, k: int, max_m: int, what: str) -> None:
    if x.dim() != 2 or not 1 <= x.shape[0] <= max_m:
        raise ValueError(f"{what} handles 2-D x with 1..{max_m} rows, got x of shape {tuple(x.shape)}; use F.linear")
    if weight.shape[1] != k or x.dtype != weight.dtype or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{what} needs weight [N, {k}] of x's dtype and unit K strides, got "
                         f"x {tuple(x.shape)} {x.dtype} stride {x.stride()}, weight {tuple(weight.shape)} "
                         f"{weight.dtype} stride {weight.stride()}")


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T + bias -> [M, N] in x's dtype, accumulated in fp32; M <= MAX_M.

    x and weight need the same dtype (bf16, fp16 or fp32) and unit stride along K. Deterministic:
    the same inputs give the same bits on every call. `config` overrides `pick_config` (benchmarks).
    """
    m, k = x.shape
    n = weight.shape[0]
    _check(x, weight, k, MAX_M, "skinny_linear")
    cfg = config or pick_config(m, n, k, _sm_count(x.device))
    if cfg.block_m < m:
        raise ValueError(f"config block_m={cfg.block_m} is smaller than M={m}")
    if not cfg.use_dot:
        return gemv(x, weight, bias, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps,
                    cfg.num_stages, fold_k=cfg.fold_k)
    return dot_linear(x, weight, bias, cfg)


def pick_silu_down_config(m: int, n: int, k: int, sm_count: int = 132) -> SkinnyConfig:
    """The GEMV config of `skinny_silu_and_mul_linear` for [m, 2k] -> [m, n]: `TUNED_SILU_DOWN` or the
    heuristic."""
    bucket = m_bucket(m)
    return TUNED_SILU_DOWN.get((bucket, n, k)) or _gemv_config(bucket, n, k, sm_count)


def skinny_silu_and_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                               config: SkinnyConfig | None = None) -> torch.Tensor:
    """(silu(gate) * up) @ weight[N, I].T + bias for gate_up [M, 2I] = [gate | up], M <= GEMV_MAX_M.

    Equals `skinny_linear(fused_ops.silu_and_mul(gate_up), weight, bias)` up to summation order (the
    activation is rounded to the input dtype the same way) in one kernel, without the SiLU launch and
    its round trip through memory. `config` (block_m <= 4) overrides `pick_silu_down_config`.
    """
    m, width = gate_up.shape
    k, n = width // 2, weight.shape[0]
    if width % 2:
        raise ValueError(f"gate_up must be [M, 2I] = [gate | up], got width {width}")
    _check(gate_up, weight, k, GEMV_MAX_M, "skinny_silu_and_mul_linear")
    cfg = config or pick_silu_down_config(m, n, k, _sm_count(gate_up.device))
    if cfg.use_dot or cfg.block_m < m:
        raise ValueError(f"skinny_silu_and_mul_linear needs a GEMV config with {m} <= block_m <= {GEMV_MAX_M}, got {cfg}")
    return gemv(gate_up, weight, bias, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps,
                cfg.num_stages, gated=True, fold_k=cfg.fold_k)


def dot_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: SkinnyConfig,
               scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The tl.dot kernel (cfg.block_m >= 16; inputs checked by the caller): x [M, K] @ weight[N, K].T + bias.

    weight has x's dtype (`scale` None), or is float8_e4m3fn with float32 scales `scale`: [N, 1] per output
    channel (`block` None), applied to each split's sum, or [ceil(N/bn), ceil(K/bk)] for `block` (bn, bk),
    applied to each K chunk's products (cfg.block_k must divide bk). Shared by `mstar.kernels.fp8_gemv`.
    """
    m, k = x.shape
    n = weight.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # rounding k_per_split up can leave fewer splits
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = _workspace(x.device, split * m * n) if split > 1 else out
    has_bias = bias is not None
    scales = "none" if scale is None else "channel" if block is None else "block"
    scale_bn, scale_bk = block or (1, 1)
    _skinny_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, weight, weight if scale is None else scale, bias if has_bias else weight, out, ws, m, n, k, x.stride(0),
        weight.stride(0), 0 if scale is None else scale.stride(0),
        HAS_BIAS=has_bias, TO_WORKSPACE=split > 1, EVEN_K=split * k_per_split == k,
        DOT_FP32=x.dtype == torch.float32 or not x.is_cuda, SCALES=scales, SCALE_BN=scale_bn, SCALE_BK=scale_bk,
        K_ITERS=k_per_split // cfg.block_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device),
    )
    if split > 1:
        block_size = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block_size),)](
            ws, bias if has_bias else ws, out, m * n, n, SPLIT=split, HAS_BIAS=has_bias, BLOCK=block_size,
            **pdl_args(x.device),
        )
    return out
