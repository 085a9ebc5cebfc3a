"""`sampling.sample_static` in one Triton launch: penalties, temperature, greedy, top-k, top-p, min-p and
the exponential race, one program per row, for the sampler CUDA graphs.

The PyTorch form takes some sixty kernels a step (a `topk` of 1,024 alone is five), about 0.1 ms of
GPU time at batch 1 over Orpheus's 28,680-id head on an H200. Here one program per row walks its
logits three times:
1. scale them (repetition penalty where the token was seen, then 1/temperature, rounded as the
   PyTorch form rounds them), store them, and find the max and its first id (greedy rows stop here);
2. sum exp(x - max) (the softmax normaliser) and count the ids per bin of (max - x) * BIN_SCALE;
3. copy the ids of the bins nearest the max, as many whole bins as fit in CANDIDATES, into a buffer
   of keys packing the float's order-preserving integer image over the complement of the id.
Where bins whose smallest possible mass already reaches top_p (and at least top_k ids) hold at most
SHORT_SORT ids, only those are copied, and sorted in a short sort. Then `tl.sort` orders the candidates
(ties lowest id first) and the rest is the prefilter race of
`sampling_filters`: top-k by rank, top-p on the cumulative mass (over the full normaliser, or the
top k's), min-p against the top probability, argmax(p / E) with the caller's Exp(1) noise E. A row
whose nucleus may reach past the candidates (flat logits: the candidates' mass is under top_p, or
fewer than top_k fit) is flagged and left to `nucleus.nucleus_race_`, the exact whole-vocabulary
bisection, which exits at once for every other row. Rows with neither top-k nor top-p race over
the whole vocabulary in a fourth walk.

On an H200 at batch 1 over Orpheus's window: 56 µs for `sample_static` against 89 in the PyTorch form
(`benchmarks/sampler_micro.py`); walks 2 and 3 take 20 µs each (the histogram's shared-memory atomics,
the copy's block-wide scan), the sorts and the race 3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels.nucleus import nucleus_race_, order_key

CANDIDATES = 1024  # = sampling_filters.PREFILTER_K: the widest top-k the sampler graphs serve
SHORT_SORT = 128  # candidates sorted in the short sort, when enough of the nucleus fits in them
BINS = 256  # bins of the distance below the max ...
BIN_SCALE = 8.0  # ... 1/8 of a logit wide: the last bin holds everything 32 or more below the max


@triton.jit
def _bins(x, top, BINS: tl.constexpr, BIN_SCALE: tl.constexpr):
    d = tl.where(x > -float("inf"), (top - x) * BIN_SCALE, BINS - 1.0)
    return tl.minimum(d, BINS - 1.0).to(tl.int32)


@triton.jit
def _sample_kernel(logits_ptr, seen_ptr, table_ptr, noise_ptr, x_ptr, cand_ptr, ids_ptr, need_ptr, lse_ptr, pmin_ptr,
                   top_p_ptr, top_k_ptr, vocab, stride_l, stride_s, stride_t, stride_n, FILTERED: tl.constexpr, NB: tl.constexpr,
                   BLOCK: tl.constexpr, CAND: tl.constexpr, SMALL: tl.constexpr, BINS: tl.constexpr,
                   BIN_SCALE: tl.constexpr, STOP: tl.constexpr = 0):
    # STOP (benchmarks/sampler_micro.py --phases): 1, 2, 3 end the kernel after the first walk, the second,
    # the candidates' copy (what it stores then is meaningless); 0 runs it all
    row = tl.program_id(0)
    t = table_ptr + row * stride_t  # RowTable.columns: 1/T, penalty, 1/penalty, top_k, top_p, min_p, greedy, filtered
    inv_temp = tl.load(t)
    seen_factor = tl.load(t + 2) * inv_temp
    seen_neg_factor = tl.load(t + 1) * inv_temp
    x_row = x_ptr + row * vocab
    # per-lane running max and its first id: one cross-warp reduction after the loop, not one per block
    lane_top = tl.full((BLOCK,), -float("inf"), tl.float32)
    lane_id = tl.zeros((BLOCK,), tl.int32)
    for b in range(NB):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        inside = offs < vocab
        raw = tl.load(logits_ptr + row * stride_l + offs, mask=inside, other=-float("inf")).to(tl.float32)
        seen = tl.load(seen_ptr + row * stride_s + offs, mask=inside, other=0)
        factor = tl.where(seen != 0, tl.where(raw > 0, seen_factor, seen_neg_factor), inv_temp)
        x = raw * factor
        tl.store(x_row + offs, x, mask=inside)
        lane_id = tl.where(x > lane_top, offs, lane_id)
        lane_top = tl.maximum(lane_top, x)
    top = tl.max(lane_top, axis=0)
    top_id = tl.min(tl.where(lane_top == top, lane_id, 2147483647), axis=0).to(tl.int64)
    if STOP == 1:
        tl.store(ids_ptr + row, top_id)
        return
    tl.debug_barrier()  # the stored logits are read back by other threads
    lane_total = tl.zeros((BLOCK,), tl.float32)
    counts = tl.zeros((BINS,), tl.int32)
    for b in range(NB):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        inside = offs < vocab
        x = tl.load(x_row + offs, mask=inside, other=-float("inf"))
        lane_total += tl.exp(x - top)
        bins = _bins(x, top, BINS, BIN_SCALE)
        # the catch-all last bin is never a candidate: left uncounted (a shared-memory atomic per id, all
        # on one address, where most of a large vocabulary lies far below the max)
        counts += tl.histogram(bins, BINS, mask=inside & (bins < BINS - 1))
    total = tl.sum(lane_total, axis=0)
    if STOP == 2:
        tl.store(ids_ptr + row, tl.sum(counts, axis=0).to(tl.int64) + total.to(tl.int64))
        return
    lse = top + tl.log(total)
    min_p = tl.load(t + 5)
    tl.store(lse_ptr + row, lse)
    tl.store(pmin_ptr + row, min_p * tl.exp(top - lse))
    tl.store(top_p_ptr + row, tl.load(t + 4))  # the fallback's parameters, contiguous
    tl.store(top_k_ptr + row, tl.load(t + 3))
    greedy = tl.load(t + 6) > 0
    filtered = tl.load(t + 7) > 0
    if FILTERED:
        _race_candidates(x_row, cand_ptr + row * CAND, noise_ptr + row * stride_n, ids_ptr + row, need_ptr + row,
                         counts, top, total, tl.load(t + 3), tl.load(t + 4), min_p, vocab, NB, BLOCK, CAND, SMALL,
                         BINS, BIN_SCALE, STOP)
    elif greedy:
        tl.store(ids_ptr + row, top_id)
        tl.store(need_ptr + row, 0)
    elif filtered:
        _race_candidates(x_row, cand_ptr + row * CAND, noise_ptr + row * stride_n, ids_ptr + row, need_ptr + row,
                         counts, top, total, tl.load(t + 3), tl.load(t + 4), min_p, vocab, NB, BLOCK, CAND, SMALL,
                         BINS, BIN_SCALE, STOP)
    else:  # neither top-k nor top-p: race over the whole vocabulary (min-p applied), as race_full does
        lane_best = tl.full((BLOCK,), -2.0, tl.float32)
        lane_id = tl.zeros((BLOCK,), tl.int32)
        for b in range(NB):
            offs = b * BLOCK + tl.arange(0, BLOCK)
            inside = offs < vocab
            x = tl.load(x_row + offs, mask=inside, other=-float("inf"))
            e = tl.load(noise_ptr + row * stride_n + offs, mask=inside, other=1.0)
            p = tl.exp(x - top) / total
            p = tl.where(p < min_p * (1.0 / total), 0.0, p)
            score = tl.where(inside, p / e, -1.0)
            lane_id = tl.where(score > lane_best, offs, lane_id)
            lane_best = tl.maximum(lane_best, score)
        best = tl.max(lane_best, axis=0)
        best_id = tl.min(tl.where(lane_best == best, lane_id, 2147483647), axis=0).to(tl.int64)
        tl.store(ids_ptr + row, best_id)
        tl.store(need_ptr + row, 0)


@triton.jit
def _race_candidates(x_row, cand_row, noise_row, id_ptr, need_ptr, counts, top, total, top_k, top_p, min_p, vocab,
                     NB: tl.constexpr, BLOCK: tl.constexpr, CAND: tl.constexpr, SMALL: tl.constexpr,
                     BINS: tl.constexpr, BIN_SCALE: tl.constexpr, STOP: tl.constexpr):
    # Candidates are whole bins nearest the max (never the last, catch-all bin). Enough of them: bins whose
    # smallest possible mass already reaches top_p, and at least top_k ids; if those fit in SMALL, only
    # they are sorted (a short sort), else as many bins as fit in CAND.
    cum_counts = tl.cumsum(counts, axis=0)
    fit = tl.minimum(tl.sum((cum_counts <= CAND).to(tl.int32), axis=0), BINS - 1)
    bin_floor = tl.exp(-(tl.arange(0, BINS) + 1).to(tl.float32) / BIN_SCALE)  # e = exp(x - max) above it
    short_p = tl.sum((tl.cumsum(counts.to(tl.float32) * bin_floor, axis=0) < top_p * total).to(tl.int32), axis=0) + 1
    short_k = tl.sum((cum_counts.to(tl.float32) < top_k).to(tl.int32), axis=0) + 1
    short = tl.maximum(tl.where(top_p < 1.0, short_p, 0), tl.where(top_k < vocab, short_k, 0))
    short_count = tl.sum(tl.where(tl.arange(0, BINS) == short - 1, cum_counts, 0), axis=0)
    use_short = (short >= 1) & (short < BINS) & (short_count <= SMALL)
    fit = tl.where(use_short, short, fit)
    base = tl.zeros((), tl.int32)
    for b in range(NB):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < vocab, other=-float("inf"))
        take = (offs < vocab) & (_bins(x, top, BINS, BIN_SCALE) < fit)
        slot = base + tl.cumsum(take.to(tl.int32), axis=0) - 1
        packed = (order_key(x) << 32) | (2147483647 - offs).to(tl.int64)
        tl.store(cand_row + slot, packed, mask=take)
        base += tl.sum(take.to(tl.int32), axis=0)
    if STOP == 3:
        tl.store(id_ptr, base.to(tl.int64))
        return
    tl.debug_barrier()  # the candidates are read back by other threads
    if base <= SMALL:
        _race_sorted(cand_row, noise_row, id_ptr, need_ptr, base, top, total, top_k, top_p, min_p, vocab, SMALL)
    else:
        _race_sorted(cand_row, noise_row, id_ptr, need_ptr, base, top, total, top_k, top_p, min_p, vocab, CAND)


@triton.jit
def _race_sorted(cand_row, noise_row, id_ptr, need_ptr, count, top, total, top_k, top_p, min_p, vocab,
                 N: tl.constexpr):
    """Sort the `count` (<= N) packed candidates and race them as `sampling_filters._race_prefiltered`."""
    ranks = tl.arange(0, N)
    valid = ranks < count
    packed = tl.sort(tl.load(cand_row + ranks, mask=valid, other=-9223372036854775807 - 1), descending=True)
    ids = 2147483647 - (packed & 0xFFFFFFFF)
    key = (packed >> 32).to(tl.int32)
    v = tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)
    e = tl.where(valid, tl.exp(v - top), 0.0)
    has_top_k = top_k < vocab  # top_k holds vocab when off
    e = tl.where(ranks.to(tl.float32) >= top_k, 0.0, e)  # top-p then renormalises over the top k
    denom = tl.where(has_top_k, tl.sum(e, axis=0), total)
    p = e / denom
    cum = tl.cumsum(p, axis=0)
    p_first = tl.sum(tl.where(ranks == 0, p, 0.0), axis=0)
    keep = valid & (cum - p < top_p) & (p >= min_p * p_first)  # the mass strictly before a token is below top_p
    last = ranks == count - 1
    cum_last = tl.sum(tl.where(last, cum, 0.0), axis=0)
    p_last = tl.sum(tl.where(last, p, 0.0), axis=0)
    covered = (has_top_k & (count.to(tl.float32) >= top_k)) | (cum_last >= top_p) | (p_last < min_p * p_first)
    noise = tl.load(noise_row + ids, mask=valid, other=1.0)
    best = tl.argmax(tl.where(keep, p / noise, -1.0), axis=0)
    tl.store(id_ptr, tl.sum(tl.where(ranks == best, ids, 0), axis=0))
    tl.store(need_ptr, (~covered).to(tl.int32))


def sample_rows(logits: torch.Tensor, table: torch.Tensor, seen: torch.Tensor, noise: torch.Tensor,
                filtered: bool = False, block: int = 16384, num_warps: int = 16, stop: int = 0) -> torch.Tensor:
    """Ids [N] (columns of `logits`) drawn from float32 `logits` [N, V] as `sampling.sample_static`
    draws them: `table` [N, C] float32 `RowTable.columns` rows, `seen` [N, V] bool seen-token masks,
    Exp(1) `noise` [N, V]; `filtered`: every row samples under top-k or top-p. Rows whose nucleus
    reaches past the candidates are redrawn over the whole vocabulary by `nucleus.nucleus_race_`.
    Two launches (nothing is copied between them), no host sync (CUDA-graph capturable). `stop` (1-3) ends the kernel early and returns
    garbage: for timing its phases alone (benchmarks/sampler_micro.py)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and seen.stride(1) == 1 and noise.stride(1) == 1 and table.stride(1) == 1
    assert seen.shape == logits.shape and noise.shape == logits.shape and table.shape[0] == rows
    x = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    cand = torch.empty(rows, CANDIDATES, dtype=torch.int64, device=logits.device)
    ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    need = torch.empty(rows, dtype=torch.int32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    pmin = torch.empty(rows, dtype=torch.float32, device=logits.device)
    top_p = torch.empty(rows, dtype=torch.float32, device=logits.device)
    top_k = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _sample_kernel[(rows,)](logits, seen.view(torch.uint8), table, noise, x, cand, ids, need, lse, pmin, top_p,
                                top_k, vocab,
                                logits.stride(0), seen.stride(0), table.stride(0), noise.stride(0),
                                FILTERED=filtered, NB=triton.cdiv(vocab, block), BLOCK=block, CAND=CANDIDATES,
                                SMALL=SHORT_SORT, BINS=BINS, BIN_SCALE=BIN_SCALE, STOP=stop, num_warps=num_warps)
        if not stop:
            nucleus_race_(x, noise, ids, need, lse, top_p, pmin, top_k=top_k)
    return ids
