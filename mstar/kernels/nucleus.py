"""Triton kernels of sampling's filters: the race over the prefiltered top-K logits, and the exact
fallback (the top-p nucleus over the whole vocabulary, no sort).

`prefilter_race_`: one program per row does all of `sampling_filters._race_prefiltered` after the
`topk` (softmax of the K best logits against the whole row's normaliser, top-k cut, cumulative mass,
top-p and min-p keep masks, coverage, the exponential race over the kept ones and the id it picks),
which in PyTorch is some thirty small kernels; in a CUDA graph each costs a few microseconds at the
small batches of decode.

`nucleus_race_`: one program per row. A row whose `need` flag is 0 returns at once, so the kernel costs one launch
when the top-k prefilter already covered every row (sampling_filters.py). Otherwise the program
bisects the nucleus threshold in the order-preserving integer image of the float32 logits: with
f(c) = the probability mass of tokens whose key is > c, a token of key c is kept iff f(c) < top_p
(the mass strictly before it in sorted order; tied logits are kept or dropped together). Each pass
evaluates f at NS split points at once, so ~10 passes over the row pin the threshold to one key;
one more pass runs the exponential race over the kept tokens (p >= pmin for min-p). With `top_k`, a
first bisection on the count of greater keys finds the k-th key (ties with it kept), and top-p then
takes its fraction of the mass at or above it (`kernels/fused_sampling.py` sends such rows here when
the top k do not fit its candidates). Given `out`, the kernel also finishes every row's draw there (clamped
into the columns, plus an offset: the token id a decode graph reads next), so that costs no launch of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def order_key(x):
    """The order-preserving integer image of float32 x, as int64."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def exp_noise(key, row, cols, vocab):
    """Exp(1) noise of row `row`, columns `cols` of a [rows, vocab] field under philox `key` (int64)."""
    return -tl.log(tl.rand(key, (row * vocab + cols).to(tl.int32)))


@triton.jit
def noise_at(noise_row, rng_ptr, row, cols, vocab, mask, SEEDED: tl.constexpr):
    """The draw's Exp(1) noise at `cols` of `row`: read from the row of a noise tensor, or (SEEDED) made by
    `exp_noise` under the key seed + draws - 1 of `rng` (int64 [2]: seed, draws; the scale kernel of
    `fused_sampling` advanced the count at the draw's start)."""
    if SEEDED:
        return exp_noise(tl.load(rng_ptr) + tl.load(rng_ptr + 1) - 1, row, cols, vocab)
    return tl.load(noise_row + cols, mask=mask, other=1.0)


@triton.jit
def _bisect(x_ptr, lse, floor, bound, vocab, COUNT: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
            NS: tl.constexpr, PASSES: tl.constexpr):
    """The least key c with f(c) < bound, f(c) = the mass (COUNT: the number) of the row's tokens
    whose key is > c and >= floor; f never increases with c, f(floor - 1) >= bound is assumed. Each
    pass evaluates f at NS split points at once."""
    lo = floor - 1
    hi = tl.full((), 2147483647, tl.int64)  # f(hi) = 0 < bound
    js = tl.arange(0, NS).to(tl.int64) + 1
    for _ in range(PASSES):
        splits = lo + ((hi - lo) * js) // (NS + 1)
        mass = tl.zeros((NS,), tl.float32)
        for b in range(NB):  # a constexpr bound: the interpreter cannot nest loops over runtime ints
            offs = b * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < vocab, other=-float("inf"))
            key = order_key(x)
            if COUNT:
                w = tl.where((offs < vocab) & (key >= floor), 1.0, 0.0)
            else:
                w = tl.where((offs < vocab) & (key >= floor), tl.exp(x - lse), 0.0)
            mass += tl.sum(tl.where(key[None, :] > splits[:, None], w[None, :], 0.0), axis=1)
        small = mass < bound  # true from some split on
        lo = tl.maximum(lo, tl.max(tl.where(small, lo, splits), axis=0))
        hi = tl.minimum(hi, tl.min(tl.where(small, splits, hi), axis=0))
    return hi

@triton.jit
def nucleus_race(x_ptr, noise_ptr, rng_ptr, ids_ptr, need_ptr, lse_ptr, top_p_ptr, pmin_ptr, top_k_ptr, out_ptr, offset,
                 vocab, stride_x, stride_n, HAS_TOP_K: tl.constexpr, OUT: tl.constexpr, SEEDED: tl.constexpr,
                 NB: tl.constexpr, BLOCK: tl.constexpr, NS: tl.constexpr, PASSES: tl.constexpr):
    row = tl.program_id(0)
    if tl.load(need_ptr + row) == 0:
        if OUT:
            _finish(out_ptr + row, tl.load(ids_ptr + row), offset, vocab)
        return
    lse = tl.load(lse_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    kept_from = tl.full((), -2147483649, tl.int64)  # the top-k cut as a key: all of the row
    kept_mass = tl.full((), 1.0, tl.float32)  # the mass top-p is a fraction of
    if HAS_TOP_K:
        top_k = tl.load(top_k_ptr + row)
        if top_k < vocab:  # g(c) = how many keys are > c; a token is kept iff g(its key) < top_k
            kept_from = _bisect(x_ptr + row * stride_x, lse, kept_from, top_k, vocab, True, NB, BLOCK, NS,
                                PASSES)
            kept_mass = tl.zeros((), tl.float32)
            for b in range(NB):
                offs = b * BLOCK + tl.arange(0, BLOCK)
                x = tl.load(x_ptr + row * stride_x + offs, mask=offs < vocab, other=-float("inf"))
                kept_mass += tl.sum(tl.where(order_key(x) >= kept_from, tl.exp(x - lse), 0.0), axis=0)
    hi = _bisect(x_ptr + row * stride_x, lse, kept_from, top_p * kept_mass, vocab, False, NB, BLOCK, NS,
                 PASSES)
    hi = tl.maximum(hi, kept_from)
    pmin = tl.load(pmin_ptr + row)
    best = tl.full((), -2.0, tl.float32)
    best_id = tl.full((), 0, tl.int64)
    for b in range(NB):
        start = b * BLOCK
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        x = tl.load(x_ptr + row * stride_x + offs, mask=inside, other=-float("inf"))
        e = noise_at(noise_ptr + row * stride_n, rng_ptr, row, offs, vocab, inside, SEEDED)
        p = tl.exp(x - lse)
        keep = inside & (order_key(x) >= hi) & (p >= pmin)
        score = tl.where(keep, p / e, -1.0)
        block_best = tl.max(score, axis=0)
        block_id = tl.argmax(score, axis=0).to(tl.int64) + start
        best_id = tl.where(block_best > best, block_id, best_id)
        best = tl.maximum(best, block_best)
    tl.store(ids_ptr + row, best_id)
    if OUT:
        _finish(out_ptr + row, best_id, offset, vocab)


@triton.jit
def _finish(out_ptr, column, offset, vocab):
    """Store a drawn column as a token id: clamped into [0, vocab) (a padding row may draw none), plus offset."""
    tl.store(out_ptr, tl.minimum(tl.maximum(column, 0), vocab - 1) + offset)



def nucleus_race_(x: torch.Tensor, noise: torch.Tensor | None, ids: torch.Tensor, need: torch.Tensor,
                  lse: torch.Tensor, top_p: torch.Tensor, pmin: torch.Tensor, top_k: torch.Tensor | None = None,
                  block: int = 1024, splits: int = 16, passes: int = 10, out: torch.Tensor | None = None,
                  offset: int = 0, rng: torch.Tensor | None = None) -> torch.Tensor:
    """Overwrite `ids[i]` (int64 [N]) for the rows with `need[i]` by the exact nucleus draw over `x`
    [N, V] float32 with Exp(1) `noise` [N, V] (or, with `rng`, the noise `noise_at` makes); `lse` [N] =
    logsumexp of x, `top_p` [N] (>= 1: off), `pmin` [N] = min_p times the top probability, `top_k` [N]
    float32 (V: off; top-p then takes its fraction of the top k's mass; tokens tied with the k-th are kept
    with it). Returns `ids`, written in place, with no host sync; with `out` (int64 [N]), every row's id
    also goes there clamped into [0, V) plus `offset`, and `out` is returned."""
    assert x.dtype == torch.float32 and x.stride(1) == 1 and ids.dtype == torch.long
    assert (noise is None) != (rng is None) and (noise is None or noise.stride(1) == 1)
    assert out is None or (out.dtype == torch.long and out.shape == ids.shape and out.is_contiguous())
    top_p = top_p.float().contiguous()
    noise = x if noise is None else noise  # not read with rng
    nucleus_race[(x.shape[0],)](x, noise, x if rng is None else rng, ids, need.to(torch.int32),
                             lse.float().contiguous(), top_p, pmin.float().contiguous(),
                             top_p if top_k is None else top_k.float().contiguous(), ids if out is None else out,
                             offset, x.shape[1], x.stride(0), noise.stride(0), HAS_TOP_K=top_k is not None,
                             OUT=out is not None, SEEDED=rng is not None, NB=-(-x.shape[1] // block), BLOCK=block,
                             NS=splits, PASSES=passes)
    return ids if out is None else out


@triton.jit
def prefilter_race(vals_ptr, idx_ptr, total_ptr, table_ptr, noise_ptr, ids_ptr, covered_ptr, lse_ptr, k,
                   vocab, stride_v, stride_t, stride_n, COL_TOP_K: tl.constexpr, COL_TOP_P: tl.constexpr,
                   COL_MIN_P: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    ranks = tl.arange(0, BLOCK)
    inside = ranks < k
    v = tl.load(vals_ptr + row * stride_v + ranks, mask=inside, other=-float("inf"))
    top = tl.load(vals_ptr + row * stride_v)  # the K best come sorted: the first is the row's max
    total = tl.load(total_ptr + row)  # sum of exp(x - top) over the whole row
    top_k = tl.load(table_ptr + row * stride_t + COL_TOP_K)
    top_p = tl.load(table_ptr + row * stride_t + COL_TOP_P)
    min_p = tl.load(table_ptr + row * stride_t + COL_MIN_P)
    e = tl.exp(v - top)
    e = tl.where(inside, e, 0.0)
    has_top_k = top_k < vocab  # top_k holds vocab when off, and ranks < k <= vocab
    e = tl.where(ranks.to(tl.float32) >= top_k, 0.0, e)  # top-p then renormalises over the top k
    denom = tl.where(has_top_k, tl.sum(e, axis=0), total)
    p = e / denom
    cum = tl.cumsum(p, axis=0)
    keep = inside & (cum - p < top_p)  # the mass strictly before a token is below top_p
    last = ranks == k - 1
    cum_last = tl.sum(tl.where(last, cum, 0.0), axis=0)
    p_last = tl.sum(tl.where(last, p, 0.0), axis=0)
    p_first = tl.sum(tl.where(ranks == 0, p, 0.0), axis=0)
    keep = keep & (p >= min_p * p_first)
    covered = (has_top_k.to(tl.int32) + (cum_last >= top_p).to(tl.int32)
               + (p_last < min_p * p_first).to(tl.int32)) > 0
    ids = tl.load(idx_ptr + row * stride_v + ranks, mask=inside, other=0)
    noise = tl.load(noise_ptr + row * stride_n + ids, mask=inside, other=1.0)
    score = tl.where(keep, p / noise, -1.0)
    best = tl.argmax(score, axis=0)
    tl.store(ids_ptr + row, tl.sum(tl.where(ranks == best, ids, 0), axis=0))
    tl.store(covered_ptr + row, covered.to(tl.int8))
    tl.store(lse_ptr + row, top + tl.log(total))



def prefilter_race_(vals: torch.Tensor, idx: torch.Tensor, total: torch.Tensor, table: torch.Tensor,
                    noise: torch.Tensor, vocab: int, columns: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
    """(ids [N] int64, covered [N] bool, lse [N] float32) of the race over the K best logits of each row:
    `vals` [N, K] float32 sorted descending with their token ids `idx` [N, K], `total` [N] = the sum of
    exp(x - vals[:, 0]) over the row's whole vocabulary, `table` [N, C] float32 rows holding top_k
    (vocab: off), top_p (>= 1: off) and min_p at `columns`, Exp(1) `noise` [N, vocab]. As
    `sampling_filters._race_prefiltered` computes them, with no host sync."""
    rows, k = vals.shape
    assert vals.dtype == torch.float32 and vals.stride(1) == 1 and idx.stride(1) == 1 and idx.shape == vals.shape
    assert vals.stride(0) == idx.stride(0) and noise.stride(1) == 1 and table.stride(1) == 1
    ids = torch.empty(rows, dtype=torch.long, device=vals.device)
    covered = torch.empty(rows, dtype=torch.int8, device=vals.device)
    lse = torch.empty(rows, dtype=torch.float32, device=vals.device)
    block = 1 << max(k - 1, 1).bit_length()
    prefilter_race[(rows,)](vals, idx, total.float().contiguous(), table, noise, ids, covered, lse, k, vocab,
                                 vals.stride(0), table.stride(0), noise.stride(0), COL_TOP_K=columns[0],
                                 COL_TOP_P=columns[1], COL_MIN_P=columns[2], BLOCK=block, num_warps=4)
    return ids, covered.bool(), lse
