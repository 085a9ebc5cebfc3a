"""Temperature, top-k, top-p and the exponential race over a small vocabulary in one Triton launch.

For heads of at most a few thousand ids (Qwen3-Omni's code predictor draws 15 codes a frame from
2,048 each): one program per row holds the row in registers, sorts it (`tl.sort` of a packed 64-bit
key: the float's order-preserving integer image above the complement of the id, so ties come out
lowest id first, as a stable descending sort gives them), then does what
`code_predictor_sampling.sample_step` does in PyTorch with some fifteen kernels: top-k by rank, the
softmax over the kept ids, the top-p cut (the mass strictly before an id must stay below top_p, so the
first id always stays), and argmax(p / E) with the caller's Exp(1) noise E per id. A row with
temperature 0 takes the argmax of its logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_VOCAB = 4096  # a row lives in one program's registers


@triton.jit
def _sample_kernel(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, noise_ptr, out_ptr, vocab, stride_l, stride_n,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_l + offs, mask=offs < vocab, other=-float("inf")).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)  # same order as the floats
    packed = tl.sort((key << 32) | (BLOCK - 1 - offs).to(tl.int64), descending=True)
    ids = BLOCK - 1 - (packed & 0xFFFFFFFF)  # ids in descending order of logit
    temperature = tl.load(temp_ptr + row)
    if temperature == 0:
        tl.store(out_ptr + row, tl.sum(tl.where(offs == 0, ids, 0), axis=0))
    else:
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
        tl.store(out_ptr + row, tl.sum(tl.where(offs == best, ids, 0), axis=0))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                noise: torch.Tensor) -> torch.Tensor:
    """Ids [B] int64 drawn from `logits` [B, V] (V <= MAX_VOCAB, unit stride over V): per row
    `temperature` [B] float32 (0: argmax), `top_k` [B] int64 (V: off), `top_p` [B] float32 (> 1: off),
    Exp(1) `noise` [B, V] (unit stride over V). No host sync."""
    rows, vocab = logits.shape
    if vocab > MAX_VOCAB or logits.stride(1) != 1 or noise.stride(1) != 1 or tuple(noise.shape) != (rows, vocab):
        raise ValueError(f"sample_rows takes [B, V <= {MAX_VOCAB}] logits and noise of that shape with unit "
                         f"stride over V; got {tuple(logits.shape)} and {tuple(noise.shape)}")
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows:
        block = triton.next_power_of_2(vocab)
        _sample_kernel[(rows,)](logits, temperature.float().contiguous(), top_k.contiguous(),
                                top_p.float().contiguous(), noise, out, vocab, logits.stride(0), noise.stride(0),
                                BLOCK=block, num_warps=min(max(block // 256, 1), 8))
    return out
