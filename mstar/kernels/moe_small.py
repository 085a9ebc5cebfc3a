"""Sparse-MoE experts for a few (token, expert) slots, as at decode: two GEMV launches, no routing sort.

With T tokens routed to top_k experts each, a decode batch has T * top_k slots, mostly on distinct
experts, and the cost is streaming each slot's expert weights from HBM once. The grouped path
(`mstar.layers.moe.experts_grouped`) first sorts the slots by expert and then runs tiles built for
many rows per expert (~20 kernels); here each slot's expert rows are read directly through `ids`:

- `_gate_up_kernel`, grid (T * top_k, cdiv(I, BLOCK_N)): program (s, n) computes BLOCK_N gate rows and
  the matching up rows of expert ids[s] against x[s // top_k], 16-byte loads along K (hidden) and
  fp32 multiply-adds into [BLOCK_N, BLOCK_K] accumulators reduced once after the K loop (as in
  `mstar.kernels.gemv`), then h[s, n] = silu(gate) * up.
- `_down_kernel`, grid (T, cdiv(H, BLOCK_N)): program (t, n) loads the BLOCK_N down_proj rows of all
  top_k experts of token t at once ([SLOTS, BLOCK_N, BLOCK_K] tiles, SLOTS = top_k rounded up to a
  power of two, the padding masked off), so one launch also does the weighted sum over the slots.

Every weight element is read once per slot, so a token's experts cost close to reading their weights
from HBM, which the grouped path's sort and many-row tiles are far from at a few tokens.

Values are rounded to the weights' dtype where the PyTorch reference (`experts_grouped`) rounds them:
the gate_up matmul output, F.silu, silu * up, the down matmul output, `y * w`; the sum over a token's
slots is fp32 with one final rounding, as `.sum(1)` of a bf16 tensor is. No host syncs and shapes fixed by T and top_k: CUDA-graph capturable. PDL
(`mstar.kernels.pdl`): each kernel lets the next launch at its start and waits before its first load
(the expert ids come from the router, so no weight can be loaded before the wait).

Use through `mstar.layers.moe.SparseMoE` (the "small" path); tests run it on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mstar.kernels.gemv import load_chunk
from mstar.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait


@dataclass(frozen=True)
class SmallMoEConfig:
    """Block sizes of the two launches (`small_config` picks them; tests pass their own)."""

    gate_up_block_n: int  # gate (and as many up) rows per program
    gate_up_block_k: int  # hidden elements per chunk
    down_block_n: int  # output columns per program (times SLOTS expert rows)
    down_block_k: int  # intermediate elements per chunk
    num_warps: int = 4


def small_config(hidden: int, intermediate: int, element_size: int) -> SmallMoEConfig:
    """Static heuristic, tuned on the Qwen3-Omni thinker and talker blocks at 1 to 8 tokens inside CUDA
    graphs: small tiles and many programs win, since a program's few chunks leave little to pipeline
    and only the number of resident programs keeps HBM busy.

    gate_up: BLOCK_K spans all warps (8 bf16 x 32 lanes x 4 warps = 1024), so each thread loads its
    slice of x once per chunk and it lines up with the weight tile (no layout shuffle, as in `gemv`'s
    BROADCAST_X); 2 gate and 2 up rows a program, the best of 1, 2 and 4 on both blocks.
    down: K is the expert's intermediate size (hundreds), so BLOCK_K is 128 (whole chunks of 768 and
    384) and BLOCK_N 2, i.e. SLOTS * 2 * 128 elements = two 16-byte loads a thread at 8 slots (wider
    column blocks leave too few programs on the talker's block).
    """
    warps = 4
    span = 16 // element_size * 32 * warps
    return SmallMoEConfig(gate_up_block_n=2, gate_up_block_k=min(span, triton.next_power_of_2(hidden)),
                          down_block_n=2, down_block_k=min(128, triton.next_power_of_2(intermediate)),
                          num_warps=warps)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, INTER, K, stride_xt, stride_we, stride_wn, stride_se,
                    TOP_K: tl.constexpr, K_CHUNKS: tl.constexpr, EVEN_K: tl.constexpr, BROADCAST_X: tl.constexpr,
                    SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    s = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    pdl_wait(PDL)  # the expert ids and x come from earlier kernels of the step
    e = tl.load(ids_ptr + s)
    # Clamped rows keep the weight loads unmasked (vectorised); they are never stored.
    gate_ptrs = w_ptr + e * stride_we + tl.minimum(rn, INTER - 1)[:, None] * stride_wn + rk[None, :]
    up_ptrs = gate_ptrs + INTER * stride_wn
    # x must share the weight tile's register layout (see gemv.py): a [1, BLOCK_K] row where BLOCK_K
    # spans every warp, else pointers of the tile's shape (each row the same addresses, L1 hits).
    if BROADCAST_X:
        x_ptrs = x_ptr + (s // TOP_K) * stride_xt + rk[None, :]
    else:
        x_ptrs = x_ptr + (s // TOP_K) * stride_xt + (rn * 0)[:, None] + rk[None, :]
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for i in range(K_CHUNKS):
        k = i * BLOCK_K
        mask = (k + rk < K)[None, :]
        x = load_chunk(x_ptrs, k, mask, EVEN_K)
        g = load_chunk(gate_ptrs, k, mask, EVEN_K)
        u = load_chunk(up_ptrs, k, mask, EVEN_K)
        xf = x.to(tl.float32)
        acc_gate += xf * g.to(tl.float32)
        acc_up += xf * u.to(tl.float32)
    dtype = h_ptr.dtype.element_ty
    gate = tl.sum(acc_gate, axis=1)
    up = tl.sum(acc_up, axis=1)
    if SCALED:  # FP8 weights: each row's scale applied to its float32 sum
        s_row = s_ptr + e * stride_se + tl.minimum(rn, INTER - 1)
        gate = gate * tl.load(s_row)
        up = up * tl.load(s_row + INTER)
    gate = gate.to(dtype).to(tl.float32)  # the gate_up matmul's output is rounded
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu rounds to the input dtype
    tl.store(h_ptr + s * INTER + rn, (act * up).to(dtype), mask=rn < INTER)  # and so does silu(gate) * up


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, ids_ptr, rw_ptr, out_ptr, H, INTER, stride_we, stride_wn, stride_se, stride_ot,
                 TOP_K: tl.constexpr, SLOTS: tl.constexpr, K_CHUNKS: tl.constexpr, EVEN_K: tl.constexpr,
                 SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    t = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, SLOTS)
    rk = tl.arange(0, BLOCK_K)
    pdl_wait(PDL)  # h comes from the gate_up kernel
    real = rj < TOP_K  # SLOTS pads top_k to a power of two; padding slots repeat the last and are masked
    slots = t * TOP_K + tl.minimum(rj, TOP_K - 1)
    e = tl.load(ids_ptr + slots)
    w_ptrs = (w_ptr + e[:, None, None] * stride_we + tl.minimum(rn, H - 1)[None, :, None] * stride_wn
              + rk[None, None, :])
    h_ptrs = h_ptr + slots[:, None, None] * INTER + (rn * 0)[None, :, None] + rk[None, None, :]  # tile-shaped: L1 hits
    acc = tl.zeros((SLOTS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for i in range(K_CHUNKS):
        k = i * BLOCK_K
        if EVEN_K and SLOTS == TOP_K:
            h = tl.load(h_ptrs + k)
            w = tl.load(w_ptrs + k)
        else:
            mask = real[:, None, None] & (k + rk < INTER)[None, None, :]
            h = tl.load(h_ptrs + k, mask=mask, other=0.0)
            w = tl.load(w_ptrs + k, mask=mask, other=0.0)
        acc += h.to(tl.float32) * w.to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    y = tl.sum(acc, axis=2)  # [SLOTS, BLOCK_N]: each slot's down matmul
    if SCALED:  # FP8 weights: each row's scale applied to its float32 sum
        y = y * tl.load(s_ptr + e[:, None] * stride_se + tl.minimum(rn, H - 1)[None, :])
    y = y.to(dtype).to(tl.float32)  # rounded
    rw = tl.load(rw_ptr + slots, mask=real, other=0.0).to(tl.float32)
    weighted = (y * rw[:, None]).to(dtype).to(tl.float32)  # `y * w` rounded
    total = tl.sum(tl.where(real[:, None], weighted, 0.0), axis=0)  # fp32 over the slots, one rounding
    tl.store(out_ptr + t * stride_ot + rn, total.to(dtype), mask=rn < H)


def experts_layout(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, ids: torch.Tensor,
                   caller: str, gate_up_scale: torch.Tensor | None = None,
                   down_scale: torch.Tensor | None = None) -> tuple[int, int, int, int, int]:
    """(T, H, top_k, E, I) of an experts call, asserting what the MoE kernels read: gate_up_proj [E, 2I, H]
    and down_proj [E, H, I] with unit last strides, in x's dtype, or FP8 (float8_e4m3fn) with float32
    row scales gate_up_scale [E, 2I] and down_scale [E, H] (unit last stride)."""
    t, hidden = x.shape
    experts, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    assert gate_up_proj.shape == (experts, 2 * inter, hidden) and down_proj.shape == (experts, hidden, inter)
    assert gate_up_proj.stride(2) == 1 and down_proj.stride(2) == 1, f"{caller}: experts need a unit K stride"
    if gate_up_scale is None:
        assert gate_up_proj.dtype == down_proj.dtype == x.dtype, f"{caller}: x and the experts share a dtype"
    else:
        assert gate_up_proj.dtype == down_proj.dtype == torch.float8_e4m3fn and down_scale is not None
        assert gate_up_scale.shape == (experts, 2 * inter) and down_scale.shape == (experts, hidden)
        assert gate_up_scale.stride(1) == down_scale.stride(1) == 1, f"{caller}: scales need a unit last stride"
    return t, hidden, ids.shape[1], experts, inter


def experts_small(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, config: SmallMoEConfig | None = None,
                  gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for x [T, H] -> [T, H] in x's dtype.

    gate_up_proj [E, 2I, H] (rows [0, I) gate, [I, 2I) up), down_proj [E, H, I], both with unit last
    stride and in x's dtype (bfloat16, float16 or float32), or FP8 with their row scales (`experts_layout`:
    each row's float32 sum times its scale, then rounded as before); ids [T, k] (int64 from topk), weights
    [T, k]. Rounded like `experts_grouped`; capturable in a CUDA graph.
    """
    t, hidden, top_k, _, inter = experts_layout(x, gate_up_proj, down_proj, ids, "experts_small",
                                                gate_up_scale, down_scale)
    scaled = gate_up_scale is not None
    gate_up_scale = gate_up_scale if scaled else x  # an unread placeholder pointer
    down_scale = down_scale if scaled else x
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or small_config(hidden, inter, x.element_size())
    ids, weights = ids.contiguous(), weights.contiguous()
    h = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    pdl = pdl_args(x.device)
    _gate_up_kernel[(t * top_k, triton.cdiv(inter, cfg.gate_up_block_n))](
        x, gate_up_proj, gate_up_scale, ids, h, inter, hidden, x.stride(0), gate_up_proj.stride(0),
        gate_up_proj.stride(1), gate_up_scale.stride(0),
        TOP_K=top_k, K_CHUNKS=triton.cdiv(hidden, cfg.gate_up_block_k), EVEN_K=hidden % cfg.gate_up_block_k == 0,
        BROADCAST_X=cfg.gate_up_block_k >= 16 // x.element_size() * 32 * cfg.num_warps, SCALED=scaled,
        BLOCK_N=cfg.gate_up_block_n, BLOCK_K=cfg.gate_up_block_k, num_warps=cfg.num_warps, **pdl,
    )
    _down_kernel[(t, triton.cdiv(hidden, cfg.down_block_n))](
        h, down_proj, down_scale, ids, weights, out, hidden, inter, down_proj.stride(0), down_proj.stride(1),
        down_scale.stride(0), out.stride(0),
        TOP_K=top_k, SLOTS=triton.next_power_of_2(top_k), K_CHUNKS=triton.cdiv(inter, cfg.down_block_k),
        EVEN_K=inter % cfg.down_block_k == 0, SCALED=scaled,
        BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k, num_warps=cfg.num_warps, **pdl,
    )
    return out
