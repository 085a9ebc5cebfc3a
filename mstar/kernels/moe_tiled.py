"""Sparse-MoE experts for decode batches of tens of tokens: each expert's weights read once, its tokens as one tile.

`kernels/moe_small.py` reads a slot's expert for every (token, expert) slot. Past about 16 tokens many
slots share an expert (at 32 tokens of the Qwen3-Omni thinker, 256 slots land on about 111 of 128
experts), and those repeated reads cost it even as L2 hits. Here the work is split by expert:

- `_slots_kernel`, grid (E,): program e lists the slots routed to expert e (in slot order) and counts them.
- `_gate_up_kernel`, grid (E, cdiv(I, BLOCK_N)): program (e, n) streams BLOCK_N gate rows and the matching
  up rows of expert e once and multiplies them with the tokens of e's slots, BLOCK_M at a time, on the
  tensor cores: acc[BLOCK_N, BLOCK_M] += W[BLOCK_N, BLOCK_K] @ X^T[BLOCK_K, BLOCK_M] (the weight rows are
  the MMA's long side, the few tokens its short one); then h[slot, n] = silu(gate) * up.
- `_down_kernel`, grid (E, cdiv(H, BLOCK_N)): likewise y[slot, n] = h[slot] @ down[e, n]^T.
- `_combine_kernel`, grid (T, cdiv(H, BLOCK)): out[t] = sum_j weights[t, j] * y[t * top_k + j].

An expert nobody routed to costs its programs one load of a count. An expert with more than BLOCK_M
slots runs its tiles one after another in the same program (its weights then come from L2).

Expert parallelism: with `first` and `local` (the rank holds experts [first, first + local)), ids stay
global; slots routed to other ranks are never computed and add nothing.

Values are rounded to the weights' dtype where the PyTorch reference (`experts_grouped`) rounds them, as
in moe_small. float32 runs its dots in IEEE float32 (no TF32). No host syncs, shapes fixed by T and top_k:
CUDA-graph capturable. PDL as in `mstar.kernels.pdl` (every load after the wait: which experts run is
only known from the router). Use through `mstar.layers.moe.SparseMoE` (the "tiled" path); tests run it on
CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from mstar.kernels.moe_small import experts_layout
from mstar.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

MAX_SLOTS = 4096  # one program of `_slots_kernel` holds all T * top_k expert ids in registers


@dataclass(frozen=True)
class TiledMoEConfig:
    """Tile sizes and launch options of the gate_up and down kernels (`tiled_config` picks them; tests and
    benchmarks pass their own). Every block is a power of two, block_m and the dot's sides >= 16."""

    block_m: int = 16  # slots per tile (the MMA's short side)
    gate_up_block_n: int = 64  # gate rows (and as many up rows) per program
    gate_up_block_k: int = 128  # hidden elements per chunk
    gate_up_warps: int = 4
    gate_up_stages: int = 3
    down_block_n: int = 64  # output columns per program
    down_block_k: int = 128  # intermediate elements per chunk
    down_warps: int = 4
    down_stages: int = 3
    combine_block: int = 256  # output columns per program of the combine


DEFAULT = TiledMoEConfig()


def tiled_config(hidden: int, intermediate: int) -> TiledMoEConfig:
    """`DEFAULT`'s tiles, clamped to small (test) sizes."""
    cfg = DEFAULT

    def fit(block: int, size: int) -> int:
        return max(16, min(block, triton.next_power_of_2(size)))

    return replace(cfg, gate_up_block_n=fit(cfg.gate_up_block_n, intermediate),
                   gate_up_block_k=fit(cfg.gate_up_block_k, hidden), down_block_n=fit(cfg.down_block_n, hidden),
                   down_block_k=fit(cfg.down_block_k, intermediate),
                   combine_block=min(cfg.combine_block, triton.next_power_of_2(hidden)))


@triton.jit
def _slots_kernel(ids_ptr, slots_ptr, counts_ptr, num_slots, first, S_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    e = tl.program_id(0)
    offs = tl.arange(0, S_PAD)
    pdl_wait(PDL)  # the ids come from the router
    ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
    mine = ids == e + first
    ones = mine.to(tl.int32)
    position = tl.cumsum(ones, axis=0) - 1
    tl.store(slots_ptr + e * S_PAD + position, offs.to(tl.int32), mask=mine)
    tl.store(counts_ptr + e, tl.sum(ones, axis=0))


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, sc_ptr, slots_ptr, counts_ptr, h_ptr, INTER, K, stride_xt, stride_we, stride_wn,
                    stride_sce, stride_se, TOP_K: tl.constexpr, K_CHUNKS: tl.constexpr, EVEN_K: tl.constexpr,
                    IEEE: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    e = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    # Clamped rows keep the weight loads unmasked along N; they are never stored.
    gate_ptrs = w_ptr + e.to(tl.int64) * stride_we + tl.minimum(rn, INTER - 1)[:, None] * stride_wn + rk[None, :]
    up_ptrs = gate_ptrs + INTER * stride_wn
    dtype = h_ptr.dtype.element_ty
    pdl_wait(PDL)  # the slot lists come from _slots_kernel, x from earlier kernels of the step
    count = tl.load(counts_ptr + e)
    m0 = 0
    while m0 < count:  # (a `while`: Triton's interpreter cannot take a loaded bound in range())
        valid = m0 + rm < count
        slot = tl.load(slots_ptr + e * stride_se + m0 + rm, mask=valid, other=0)
        x_ptrs = x_ptr + (slot // TOP_K)[None, :] * stride_xt + rk[:, None]  # X^T: [BLOCK_K, BLOCK_M]
        acc_gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for i in range(K_CHUNKS):
            k = i * BLOCK_K
            if EVEN_K:
                x = tl.load(x_ptrs + k, mask=valid[None, :], other=0.0)
                g = tl.load(gate_ptrs + k)
                u = tl.load(up_ptrs + k)
            else:
                kin = k + rk < K
                x = tl.load(x_ptrs + k, mask=kin[:, None] & valid[None, :], other=0.0)
                g = tl.load(gate_ptrs + k, mask=kin[None, :], other=0.0)
                u = tl.load(up_ptrs + k, mask=kin[None, :], other=0.0)
            if SCALED:  # FP8 weights: both sides widened to float32 (exact in TF32: E4M3 and bfloat16 fit its
                g = g.to(tl.float32)  # 10-bit mantissa), the row scales applied after the sum
                u = u.to(tl.float32)
                x = x.to(tl.float32)
            if IEEE:
                acc_gate = tl.dot(g, x, acc_gate, input_precision="ieee")
                acc_up = tl.dot(u, x, acc_up, input_precision="ieee")
            else:
                acc_gate = tl.dot(g, x, acc_gate)
                acc_up = tl.dot(u, x, acc_up)
        if SCALED:
            s_rows = sc_ptr + e.to(tl.int64) * stride_sce + tl.minimum(rn, INTER - 1)
            acc_gate = acc_gate * tl.load(s_rows)[:, None]
            acc_up = acc_up * tl.load(s_rows + INTER)[:, None]
        gate = acc_gate.to(dtype).to(tl.float32)  # the gate_up matmul's output is rounded
        up = acc_up.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu rounds to the input dtype
        tl.store(h_ptr + slot[None, :] * INTER + rn[:, None], (act * up).to(dtype),
                 mask=valid[None, :] & (rn < INTER)[:, None])  # and so does silu(gate) * up
        m0 += BLOCK_M


@triton.jit
def _down_kernel(h_ptr, w_ptr, sc_ptr, slots_ptr, counts_ptr, y_ptr, H, INTER, stride_we, stride_wn, stride_sce,
                 stride_se, K_CHUNKS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    e = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + tl.minimum(rn, H - 1)[:, None] * stride_wn + rk[None, :]
    dtype = y_ptr.dtype.element_ty
    pdl_wait(PDL)  # h comes from the gate_up kernel
    count = tl.load(counts_ptr + e)
    m0 = 0
    while m0 < count:  # (a `while`: Triton's interpreter cannot take a loaded bound in range())
        valid = m0 + rm < count
        slot = tl.load(slots_ptr + e * stride_se + m0 + rm, mask=valid, other=0)
        h_ptrs = h_ptr + slot[None, :] * INTER + rk[:, None]  # H^T: [BLOCK_K, BLOCK_M]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for i in range(K_CHUNKS):
            k = i * BLOCK_K
            if EVEN_K:
                h = tl.load(h_ptrs + k, mask=valid[None, :], other=0.0)
                w = tl.load(w_ptrs + k)
            else:
                kin = k + rk < INTER
                h = tl.load(h_ptrs + k, mask=kin[:, None] & valid[None, :], other=0.0)
                w = tl.load(w_ptrs + k, mask=kin[None, :], other=0.0)
            if SCALED:  # as in the gate_up kernel
                w = w.to(tl.float32)
                h = h.to(tl.float32)
            if IEEE:
                acc = tl.dot(w, h, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, h, acc)
        if SCALED:
            acc = acc * tl.load(sc_ptr + e.to(tl.int64) * stride_sce + tl.minimum(rn, H - 1))[:, None]
        tl.store(y_ptr + slot[None, :] * H + rn[:, None], acc.to(dtype),  # the down matmul's output, rounded
                 mask=valid[None, :] & (rn < H)[:, None])
        m0 += BLOCK_M


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, rw_ptr, out_ptr, H, first, local, stride_ot, TOP_K: tl.constexpr,
                    SLOTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    t = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rj = tl.arange(0, SLOTS)
    slots = t * TOP_K + tl.minimum(rj, TOP_K - 1)
    pdl_wait(PDL)  # y comes from the down kernel
    e = tl.load(ids_ptr + slots) - first
    here = (rj < TOP_K) & (e >= 0) & (e < local)  # SLOTS pads top_k to a power of two; other ranks' experts
    y = tl.load(y_ptr + slots[:, None] * H + rn[None, :], mask=here[:, None] & (rn < H)[None, :], other=0.0)
    rw = tl.load(rw_ptr + slots, mask=here, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    weighted = (y.to(tl.float32) * rw[:, None]).to(dtype).to(tl.float32)  # `y * w` rounded
    total = tl.sum(tl.where(here[:, None], weighted, 0.0), axis=0)  # fp32 over the slots, one rounding
    tl.store(out_ptr + t * stride_ot + rn, total.to(dtype), mask=rn < H)


def experts_tiled(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, first: int = 0, config: TiledMoEConfig | None = None,
                  gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for x [T, H] -> [T, H] in x's dtype, over the experts
    held here: gate_up_proj [E, 2I, H] (rows [0, I) gate, [I, 2I) up) and down_proj [E, H, I] are experts
    [first, first + E) of the block (all of them unless expert-parallel); ids [T, k] are global expert ids
    (distinct within a token, as top-k gives them), weights [T, k]. Slots routed elsewhere add nothing.
    Weights with unit last stride, in x's dtype (bfloat16, float16 or float32), or FP8 with their row scales
    (`moe_small.experts_layout`; each E4M3 tile and its activations are widened to float32 for the dot,
    TF32 on CUDA, which holds E4M3 and bfloat16 values exactly; each row's float32 sum is scaled, then rounded
    as before). Capturable in a CUDA graph.
    """
    t, hidden, top_k, local, inter = experts_layout(x, gate_up_proj, down_proj, ids, "experts_tiled",
                                                    gate_up_scale, down_scale)
    scaled = gate_up_scale is not None
    gate_up_scale = gate_up_scale if scaled else x  # an unread placeholder pointer
    down_scale = down_scale if scaled else x
    num_slots = t * top_k
    if num_slots > MAX_SLOTS:
        raise ValueError(f"experts_tiled takes at most {MAX_SLOTS} (token, expert) slots, got {t} x {top_k}")
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or tiled_config(hidden, inter)
    ids, weights = ids.contiguous(), weights.contiguous()
    s_pad = max(16, triton.next_power_of_2(num_slots))
    slots = torch.empty((local, s_pad), dtype=torch.int32, device=x.device)
    counts = torch.empty((local,), dtype=torch.int32, device=x.device)
    h = torch.empty((num_slots, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)
    pdl = pdl_args(x.device)
    ieee = x.dtype == torch.float32
    _slots_kernel[(local,)](ids, slots, counts, num_slots, first, S_PAD=s_pad, num_warps=4, **pdl)
    _gate_up_kernel[(local, triton.cdiv(inter, cfg.gate_up_block_n))](
        x, gate_up_proj, gate_up_scale, slots, counts, h, inter, hidden, x.stride(0), gate_up_proj.stride(0),
        gate_up_proj.stride(1), gate_up_scale.stride(0), s_pad, TOP_K=top_k, K_CHUNKS=triton.cdiv(hidden, cfg.gate_up_block_k),
        EVEN_K=hidden % cfg.gate_up_block_k == 0, IEEE=ieee, SCALED=scaled, BLOCK_M=cfg.block_m, BLOCK_N=cfg.gate_up_block_n,
        BLOCK_K=cfg.gate_up_block_k, num_warps=cfg.gate_up_warps, num_stages=cfg.gate_up_stages, **pdl,
    )
    _down_kernel[(local, triton.cdiv(hidden, cfg.down_block_n))](
        h, down_proj, down_scale, slots, counts, y, hidden, inter, down_proj.stride(0), down_proj.stride(1),
        down_scale.stride(0), s_pad, K_CHUNKS=triton.cdiv(inter, cfg.down_block_k), EVEN_K=inter % cfg.down_block_k == 0,
        IEEE=ieee, SCALED=scaled, BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k,
        num_warps=cfg.down_warps, num_stages=cfg.down_stages, **pdl,
    )
    _combine_kernel[(t, triton.cdiv(hidden, cfg.combine_block))](
        y, ids, weights, out, hidden, first, local, out.stride(0), TOP_K=top_k,
        SLOTS=triton.next_power_of_2(top_k), BLOCK=cfg.combine_block, num_warps=4, **pdl,
    )
    return out
