"""Structured outputs' token mask applied to logits in place as one Triton launch, for inside CUDA graphs.

`mask_logits_(logits, bitmask, flags, offset)`: in each row i of float32 `logits` [N, V] (columns are the
token ids offset .. offset + V - 1) whose flags[i] is not 0, every token whose bit is clear in the packed
int32 row bitmask[i] (bit b of word w: token 32 * w + b; tokens past the row's words: clear) becomes -inf.
A program covers BLOCK columns of one row; the logits are only written, never read, and a row whose flag
is 0 reads nothing but its flag, so a batch without a constrained row costs one tiny launch. Launched
without PDL: the draw after it sees every -inf it wrote (`kernels/pdl.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # columns per program


@triton.jit
def _mask_kernel(logits, logits_stride, bitmask, bitmask_stride, words, flags, offset, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    active = tl.load(flags + row) != 0
    ids = cols + offset
    word = ids // 32
    inside = (cols < V) & active
    bits = tl.load(bitmask + row.to(tl.int64) * bitmask_stride + word, mask=inside & (word < words), other=0)
    forbidden = ((bits >> (ids % 32)) & 1) == 0
    tl.store(logits + row.to(tl.int64) * logits_stride + cols, float("-inf"), mask=inside & forbidden)


def mask_logits_(logits: torch.Tensor, bitmask: torch.Tensor, flags: torch.Tensor, offset: int = 0) -> None:
    """Apply the token mask in place (module docstring); `bitmask` int32 [>= N, W] and `flags` int32 [>= N]
    on the logits' device, each row contiguous."""
    n, vocab = logits.shape
    if n == 0:
        return
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1 and flags.is_contiguous(), "rows must be contiguous"
    grid = (n, triton.cdiv(vocab, BLOCK))
    _mask_kernel[grid](logits, logits.stride(0), bitmask, bitmask.stride(0), bitmask.shape[1], flags, offset, vocab,
                       BLOCK=BLOCK)
