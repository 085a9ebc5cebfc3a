"""An output head that scores, per row, only a window of ids chosen by the row's input token.

Some heads know before the forward which few ids the next token can be: Orpheus speaks seven tokens a
SNAC frame, and a token at frame place p can only be one of the 4,095 codes of place p (or end of
speech); which place comes next follows from the token just fed. Scoring the whole audio span there
reads 28,680 head rows a step (176 MB at Orpheus-3B's width, a visible share of a decode step) where
4,096 rows hold every id that can be said.

`window_logits(hidden, weight, input_ids, windows)`: float32 logits [M, width] over the head `weight`
[width, K] (a contiguous row slice of the LM head) where row m holds the dot products of columns
[starts[input_ids[m]], + window) and of the `always` columns, and -inf everywhere else
(`mstar.layers.logit_windows.LogitWindows`). One launch does all of it: each program reads one row of x
and BLOCK_N of the row's window rows (or its `always` rows) over the whole of K, accumulating in fp32
like the GEMV, writes their logits and -inf over its share of the columns outside the window. Up to
MAX_M rows (`fits`); with more, the rows' windows would read more than the whole head, and the layer
masks the whole head's logits instead (`masked_window_logits`, also the reference).

PDL (sm_90+, `mstar.kernels.pdl`): lets the next kernel launch at its start and waits for the previous
one before it reads the input ids (a prefill step gathers them in the kernel just before) or anything
else, so it keeps the contract without early reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels.gemv import load_chunk
from mstar.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait
from mstar.layers.logit_windows import LogitWindows

MAX_M = 6  # more rows read more than the whole head (7 windows of Orpheus cover it): mask it instead


@triton.jit
def _window_head_kernel(x_ptr, w_ptr, ids_ptr, starts_ptr, always_ptr, out_ptr, K, COLUMNS, stride_xm, stride_wn,
                        stride_om, WIDTH: tl.constexpr, N_ALWAYS: tl.constexpr, FILL: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, EVEN_K: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    pid = tl.program_id(0)
    m = tl.program_id(1)
    start = tl.load(starts_ptr + tl.load(ids_ptr + m))
    # this program's outputs: j < WIDTH is window column start + j, the rest the `always` columns
    j = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = j < WIDTH + N_ALWAYS
    extra = tl.load(always_ptr + tl.maximum(j - WIDTH, 0), mask=valid & (j >= WIDTH), other=0)
    cols = tl.where(j < WIDTH, start + j, extra)
    cols = tl.where(valid, cols, start)  # past the end: a real row, read and never stored
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + m * stride_xm + rk[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for i in range(K_ITERS):
        k = i * BLOCK_K
        k_mask = (k + rk < K)[None, :]
        w = load_chunk(w_ptrs, k, k_mask, EVEN_K)
        x = load_chunk(x_ptrs, k, k_mask, EVEN_K)
        acc += w.to(tl.float32) * x.to(tl.float32)
    out_row = out_ptr + m * stride_om
    tl.store(out_row + cols, tl.sum(acc, axis=1), mask=valid)
    # -inf over this program's share of the row, skipping the scored columns (other programs write those)
    c = pid * FILL + tl.arange(0, FILL)
    scored = (c >= start) & (c < start + WIDTH)
    for i in tl.static_range(N_ALWAYS):
        scored = scored | (c == tl.load(always_ptr + i))
    tl.store(out_row + c, tl.full((FILL,), float("-inf"), tl.float32), mask=(c < COLUMNS) & ~scored)


def fits(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `window_logits` serves hidden [M, K] over `weight`: 1..MAX_M rows of unit stride, one dtype,
    a contiguous head."""
    return 0 < hidden.shape[0] <= MAX_M and hidden.dtype == weight.dtype and hidden.stride(1) == 1 \
        and weight.is_contiguous()


def window_logits(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor, windows: LogitWindows,
                  block_n: int = 8, block_k: int = 1024, num_warps: int = 4, num_stages: int = 2,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits [M, weight rows] of `hidden` [M, K] (`fits`) over each row's window (module
    docstring) in one launch; `input_ids` [M] (on hidden's device) picks the windows. Written into `out`
    when given (float32 [M, weight rows], unit column stride: e.g. rows of a buffer a sampler graph
    reads, saving the copy into it). The default launch config is tuned for Orpheus' head at the few
    rows of decode."""
    m, k = hidden.shape
    columns = weight.shape[0]
    if out is None:
        out = torch.empty((m, columns), dtype=torch.float32, device=hidden.device)
    elif out.shape != (m, columns) or out.dtype != torch.float32 or out.stride(1) != 1 or out.device != hidden.device:
        raise ValueError(f"window_logits: out must be float32 [{m}, {columns}] of unit column stride on "
                         f"{hidden.device}, got {out.dtype} {tuple(out.shape)} stride {out.stride()} on {out.device}")
    programs = triton.cdiv(windows.width + len(windows.always), block_n)
    _window_head_kernel[(programs, m)](
        hidden, weight, input_ids, windows.starts, windows.always_tensor, out, k, columns,
        hidden.stride(0), weight.stride(0), out.stride(0), WIDTH=windows.width, N_ALWAYS=len(windows.always),
        FILL=triton.next_power_of_2(triton.cdiv(columns, programs)), BLOCK_N=block_n, BLOCK_K=block_k,
        K_ITERS=triton.cdiv(k, block_k), EVEN_K=k % block_k == 0, num_warps=num_warps, num_stages=num_stages,
        **pdl_args(hidden.device))
    return out
