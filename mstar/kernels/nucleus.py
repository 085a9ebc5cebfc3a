"""Triton kernel of sampling's exact fallback: the top-p nucleus over the whole vocabulary, no sort.

One program per row. A row whose `need` flag is 0 returns at once, so the kernel costs one launch
when the top-k prefilter already covered every row (sampling_filters.py). Otherwise the program
bisects the nucleus threshold in the order-preserving integer image of the float32 logits: with
f(c) = the probability mass of tokens whose key is > c, a token of key c is kept iff f(c) < top_p
(the mass strictly before it in sorted order; tied logits are kept or dropped together). Each pass
evaluates f at NS split points at once, so ~10 passes over the row pin the threshold to one key;
one more pass runs the exponential race over the kept tokens (p >= pmin for min-p).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def nucleus_race_available() -> bool:
    """Whether triton imports (the CUDA path uses the kernel only then)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def nucleus_race(x_ptr, noise_ptr, ids_ptr, need_ptr, lse_ptr, top_p_ptr, pmin_ptr, vocab, stride_x,
                     stride_n, NB: tl.constexpr, BLOCK: tl.constexpr, NS: tl.constexpr, PASSES: tl.constexpr):
        row = tl.program_id(0)
        if tl.load(need_ptr + row) == 0:
            return
        lse = tl.load(lse_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        lo = tl.full((), -2147483649, tl.int64)  # f(lo) = all the mass (>= top_p)
        hi = tl.full((), 2147483647, tl.int64)  # f(hi) = 0 < top_p
        js = tl.arange(0, NS).to(tl.int64) + 1
        for _ in range(PASSES):
            splits = lo + ((hi - lo) * js) // (NS + 1)
            mass = tl.zeros((NS,), tl.float32)
            for b in range(NB):  # a constexpr bound: the interpreter cannot nest loops over runtime ints
                start = b * BLOCK
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(x_ptr + row * stride_x + offs, mask=offs < vocab, other=-float("inf"))
                p = tl.exp(x - lse)
                bits = x.to(tl.int32, bitcast=True)  # order-preserving integer key of x
                key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
                above = key[None, :] > splits[:, None]
                mass += tl.sum(tl.where(above, p[None, :], 0.0), axis=1)
            small = mass < top_p  # true from some split on (f does not increase with the key)
            lo = tl.maximum(lo, tl.max(tl.where(small, lo, splits), axis=0))
            hi = tl.minimum(hi, tl.min(tl.where(small, splits, hi), axis=0))
        pmin = tl.load(pmin_ptr + row)
        best = tl.full((), -2.0, tl.float32)
        best_id = tl.full((), 0, tl.int64)
        for b in range(NB):
            start = b * BLOCK
            offs = start + tl.arange(0, BLOCK)
            inside = offs < vocab
            x = tl.load(x_ptr + row * stride_x + offs, mask=inside, other=-float("inf"))
            e = tl.load(noise_ptr + row * stride_n + offs, mask=inside, other=1.0)
            p = tl.exp(x - lse)
            bits = x.to(tl.int32, bitcast=True)
            key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
            keep = inside & (key >= hi) & (p >= pmin)
            score = tl.where(keep, p / e, -1.0)
            block_best = tl.max(score, axis=0)
            block_id = tl.argmax(score, axis=0).to(tl.int64) + start
            best_id = tl.where(block_best > best, block_id, best_id)
            best = tl.maximum(best, block_best)
        tl.store(ids_ptr + row, best_id)

    return nucleus_race


def nucleus_race_(x: torch.Tensor, noise: torch.Tensor, ids: torch.Tensor, need: torch.Tensor, lse: torch.Tensor,
                  top_p: torch.Tensor, pmin: torch.Tensor, block: int = 1024, splits: int = 16,
                  passes: int = 10) -> torch.Tensor:
    """Overwrite `ids[i]` (int64 [N]) for the rows with `need[i]` by the exact nucleus draw over `x`
    [N, V] float32 with Exp(1) `noise` [N, V]; `lse` [N] = logsumexp of x, `top_p` [N] (>= 1: off),
    `pmin` [N] = min_p times the top probability. Returns `ids`, written in place, with no host sync."""
    assert x.dtype == torch.float32 and x.stride(1) == 1 and noise.stride(1) == 1 and ids.dtype == torch.long
    _kernel()[(x.shape[0],)](x, noise, ids, need.to(torch.int32), lse.float().contiguous(),
                             top_p.float().contiguous(), pmin.float().contiguous(), x.shape[1], x.stride(0),
                             noise.stride(0), NB=-(-x.shape[1] // block), BLOCK=block, NS=splits, PASSES=passes)
    return ids
