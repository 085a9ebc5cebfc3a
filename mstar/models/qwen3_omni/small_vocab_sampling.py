"""Temperature, top-k, top-p and the exponential race over a small vocabulary in one Triton launch.

For heads of at most a few thousand ids (Qwen3-Omni's code predictor draws 15 codes a frame from
2,048 each): one program per row holds the row in registers, sorts it (`tl.sort` of a packed 64-bit
key: the float's order-preserving integer image above the complement of the id, so ties come out
lowest id first, as a stable descending sort gives them), then does what
`code_predictor_sampling.sample_step` does in PyTorch with some fifteen kernels: top-k by rank, the
softmax over the kept ids, the top-p cut (the mass strictly before an id must stay below top_p, so the
first id always stays), and argmax(p / E) with the caller's Exp(1) noise E per id. A row with
temperature 0 takes the argmax of its logits.

`sample_embed_rows` also does what the code predictor does with each drawn code: it looks the code up
in the codebook's embedding table and adds that row to the frame's running embedding sum, in the same
program (the lookup and the add were two PyTorch kernels a step). Logits may be bf16/fp16 (read as
float32, as `.float()` would make them: exact), so the head's output needs no float32 copy either.

PDL (sm_90+, `mstar.kernels.pdl`): lets the next kernel launch at its start and waits for the previous
one before its first load or store, so the code predictor's launches stay chained through its sampler.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

MAX_VOCAB = 4096  # a row lives in one program's registers


@triton.jit
def _sample_kernel(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, noise_ptr, out_ptr, table_ptr, sum_ptr, x_out_ptr,
                   sum_out_ptr, vocab, hidden, table_rows, stride_l, stride_n, stride_t, BLOCK: tl.constexpr,
                   GREEDY: tl.constexpr, EMBED: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_l + offs, mask=offs < vocab, other=-float("inf")).to(tl.float32)
    if GREEDY:  # every row greedy: the argmax (lowest id among equal logits, as torch's), no sort
        picked = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64)
    else:
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)  # same order as the floats
        packed = tl.sort((key << 32) | (BLOCK - 1 - offs).to(tl.int64), descending=True)
        ids = BLOCK - 1 - (packed & 0xFFFFFFFF)  # ids in descending order of logit
        picked = tl.sum(tl.where(offs == 0, ids, 0), axis=0)  # the argmax
        temperature = tl.load(temp_ptr + row)
        if temperature != 0:
            valid = ids < vocab
            xs = tl.load(logits_ptr + row * stride_l + ids, mask=valid, other=-float("inf")).to(tl.float32)
            xs = xs / temperature
            xs = tl.where(offs < tl.load(top_k_ptr + row), xs, -float("inf"))
            e = tl.exp(xs - tl.max(xs, axis=0))
            p = e / tl.sum(e, axis=0)
            keep = valid & (tl.cumsum(p, axis=0) - p < tl.load(top_p_ptr + row))
            noise = tl.load(noise_ptr + row * stride_n + ids, mask=valid, other=1.0)
            score = tl.where(keep, p / noise, -1.0)
            best = tl.argmax(score, axis=0)
            picked = tl.sum(tl.where(offs == best, ids, 0), axis=0)
    tl.store(out_ptr + row, picked)
    if EMBED:  # the code's embedding row, and the running sum plus it (rounded as `sum + row` in torch)
        h = tl.arange(0, BLOCK_H)
        hmask = h < hidden
        row_id = tl.minimum(tl.maximum(picked, 0), table_rows - 1)  # in the table whatever the logits held (NaN)
        emb = tl.load(table_ptr + row_id * stride_t + h, mask=hmask, other=0.0)
        acc = tl.load(sum_ptr + row * hidden + h, mask=hmask, other=0.0)
        tl.store(x_out_ptr + row * hidden + h, emb, mask=hmask)
        tl.store(sum_out_ptr + row * hidden + h, (acc.to(tl.float32) + emb.to(tl.float32)).to(acc.dtype), mask=hmask)


def _check(logits: torch.Tensor, noise: torch.Tensor | None) -> None:
    rows, vocab = logits.shape
    if vocab > MAX_VOCAB or logits.stride(1) != 1 or (noise is not None and (
            noise.stride(1) != 1 or tuple(noise.shape) != (rows, vocab))):
        raise ValueError(f"sample_rows takes [B, V <= {MAX_VOCAB}] logits and noise of that shape with unit "
                         f"stride over V; got {tuple(logits.shape)} and "
                         f"{None if noise is None else tuple(noise.shape)}")


def _launch(logits, temperature, top_k, top_p, noise, out, table=None, embed_sum=None, x_out=None, sum_out=None):
    rows, vocab = logits.shape
    block = triton.next_power_of_2(vocab)
    embed = table is not None
    hidden = table.shape[1] if embed else 1
    _sample_kernel[(rows,)](
        logits, temperature, top_k, top_p, noise if noise is not None else logits, out,
        table if embed else logits, embed_sum if embed else logits, x_out if embed else logits,
        sum_out if embed else logits, vocab, hidden, table.shape[0] if embed else 1, logits.stride(0),
        noise.stride(0) if noise is not None else 0,
        table.stride(0) if embed else 0, BLOCK=block, GREEDY=noise is None, EMBED=embed,
        BLOCK_H=triton.next_power_of_2(hidden), num_warps=min(max(block // 256, 1), 8), **pdl_args(logits.device))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                noise: torch.Tensor) -> torch.Tensor:
    """Ids [B] int64 drawn from `logits` [B, V] (V <= MAX_VOCAB, unit stride over V): per row
    `temperature` [B] float32 (0: argmax), `top_k` [B] int64 (V: off), `top_p` [B] float32 (> 1: off),
    Exp(1) `noise` [B, V] (unit stride over V). No host sync."""
    _check(logits, noise)
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    if logits.shape[0]:
        _launch(logits, temperature.float().contiguous(), top_k.contiguous(), top_p.float().contiguous(), noise, out)
    return out


def sample_embed_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      noise: torch.Tensor | None, table: torch.Tensor, embed_sum: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample_rows` (`noise` None: every row greedy, the argmax), then each drawn id's row of the
    embedding `table` [V', H] (unit stride over H) and `embed_sum` [B, H] plus that row: (ids [B],
    rows [B, H], new sums [B, H]), the last two new contiguous tensors in the table's dtype. No host sync."""
    _check(logits, noise)
    rows = logits.shape[0]
    if table.stride(1) != 1 or embed_sum.shape != (rows, table.shape[1]) or not embed_sum.is_contiguous() \
            or embed_sum.dtype != table.dtype:
        raise ValueError(f"sample_embed_rows takes a [V, H] table with unit stride over H and a contiguous [B, H] "
                         f"sum of its dtype; got {tuple(table.shape)} {table.dtype} and "
                         f"{tuple(embed_sum.shape)} {embed_sum.dtype}")
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    x_out, sum_out = torch.empty_like(embed_sum), torch.empty_like(embed_sum)
    if rows:
        _launch(logits, temperature.float().contiguous(), top_k.contiguous(), top_p.float().contiguous(), noise, out,
                table, embed_sum, x_out, sum_out)
    return out, x_out, sum_out
