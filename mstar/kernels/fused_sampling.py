"""`sampling.sample_static` in five small Triton launches (and the fallback's): penalties, temperature, greedy, top-k,
top-p, min-p and the exponential race, each row split over several programs, for the sampler CUDA graphs.

The PyTorch form takes some sixty kernels a step (a `topk` of 1,024 alone is five), each a small
launch that leaves most of the GPU idle. A row is cut into slices of SLICE ids, one program each (28
for Orpheus's head), so a step's walks over the row run on as many SMs instead of one:
1. `_scale_kernel`: scale the slice's logits (repetition penalty where the token was seen, then
   1/temperature, rounded as the PyTorch form rounds them), store them, and keep the slice's max, its
   first id and the sum of exp(x - slice max);
2. `_count_kernel`: with the row's max (from the slices' maxima), count the slice's ids per bin of
   (max - x) * BIN_SCALE;
3. `_gather_kernel`: from all slices' counts (the same in every program), choose the bins nearest the
   max to copy: as many whole bins as fit in CANDIDATES, or, where bins whose smallest possible mass
   already reaches top_p (and at least top_k ids) hold at most FEW_CANDIDATES ids, only those; each slice
   copies its ids of them, as keys packing the float's order-preserving integer image over the
   complement of the id, at the offset the slices before it fill (no atomics: the buffer's order is the
   ids' order, as one program would write it); the first program stores the row's candidate count;
4. `_rank_kernel`: the candidates in descending order (ties lowest id first), RANK_BLOCK of them a
   program: each one's rank is the number of larger keys, where it is stored (a `tl.sort` of 1,024
   keys in one program would be most of the race's time);
5. `_race_kernel`, one program per row: the normaliser from the slices' sums, then the prefilter race of
   `sampling_filters` runs over the sorted candidates: top-k by rank,
   top-p on the cumulative mass (over the full normaliser, or the top k's), min-p against the top
   probability, argmax(p / E) with Exp(1) noise E. Greedy rows take the first max; rows with
   neither top-k nor top-p race over the whole row.
A row whose nucleus may reach past the candidates (flat logits: the candidates' mass is under top_p, or
fewer than top_k fit) is flagged and left to `nucleus.nucleus_race_`, the exact whole-vocabulary
bisection, which exits at once for every other row (and, given `out`, finishes every row's id there).

The noise is the caller's tensor, or (`rng`, filtered batches) philox's under a seed plus a draw count
that the scale kernel advances on the device, made only where the race and the fallback read it: no
noise launch, and no PyTorch generator in a CUDA graph (whose replay would first refresh its state).
`benchmarks/sampler_micro.py` times it against the PyTorch form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels.nucleus import noise_at, nucleus_race_, order_key

CANDIDATES = 1024  # = sampling_filters.PREFILTER_K: the widest top-k the sampler graphs serve
FEW_CANDIDATES = 128  # candidates copied and raced when enough of the nucleus fits in them
BINS = 256  # bins of the distance below the max ...
BIN_SCALE = 8.0  # ... 1/8 of a logit wide: the last bin holds everything 32 or more below the max
RANK_BLOCK = 8  # candidates a program of `_rank_kernel` places ...
RANK_SWEEP = 256  # ... comparing them with this many of the row's candidates at a time ...
RANK_WARPS = 4  # ... in this many warps
SLICE = 1024  # ids per program of kernels 1-3 ...
MAX_PARTS = 32  # ... or more, so that a row has at most this many (each program reads every slice's counts)


@triton.jit
def _bins(x, top, BINS: tl.constexpr, BIN_SCALE: tl.constexpr):
    d = tl.where(x > -float("inf"), (top - x) * BIN_SCALE, BINS - 1.0)
    return tl.minimum(d, BINS - 1.0).to(tl.int32)


@triton.jit
def _skips(t, FILTERED: tl.constexpr):
    """Whether a row needs no candidates: greedy, or neither top-k nor top-p (never in the FILTERED variant)."""
    if FILTERED:
        return False
    return (tl.load(t + 6) > 0) | (tl.load(t + 7) == 0)


@triton.jit
def _row_top(pmax_ptr, pid_ptr, psum_ptr, row, parts, PB: tl.constexpr):
    """The row's max, its first id and sum(exp(x - max)), from its slices' (in slice order, so every program
    that asks gets the same float)."""
    p = tl.arange(0, PB)
    inside = p < parts
    maxima = tl.load(pmax_ptr + row * parts + p, mask=inside, other=-float("inf"))
    top = tl.max(maxima, axis=0)
    top_id = tl.min(tl.where(inside & (maxima == top), tl.load(pid_ptr + row * parts + p, mask=inside, other=0),
                             2147483647), axis=0)
    sums = tl.load(psum_ptr + row * parts + p, mask=inside, other=0.0)
    total = tl.sum(tl.where(maxima > -float("inf"), sums * tl.exp(maxima - top), 0.0), axis=0)
    return top, top_id.to(tl.int64), total


@triton.jit
def _slice_counts(counts_ptr, row, parts, PB: tl.constexpr, BINS: tl.constexpr):
    """The row's bin counts per slice, [PB, BINS] (rows past `parts` zero)."""
    p = tl.arange(0, PB)
    return tl.load(counts_ptr + (row * parts + p[:, None]) * BINS + tl.arange(0, BINS)[None, :],
                   mask=(p < parts)[:, None], other=0)


@triton.jit
def _fit(counts, total, top_k, top_p, vocab, CAND: tl.constexpr, SMALL: tl.constexpr, BINS: tl.constexpr,
         BIN_SCALE: tl.constexpr):
    """How many bins nearest the max are candidates (never the last, catch-all bin). Enough of them: bins
    whose smallest possible mass already reaches top_p, and at least top_k ids; if those fit in SMALL, only
    they are copied (a short race), else as many bins as fit in CAND."""
    cum_counts = tl.cumsum(counts, axis=0)
    fit = tl.minimum(tl.sum((cum_counts <= CAND).to(tl.int32), axis=0), BINS - 1)
    bin_floor = tl.exp(-(tl.arange(0, BINS) + 1).to(tl.float32) / BIN_SCALE)  # e = exp(x - max) above it
    short_p = tl.sum((tl.cumsum(counts.to(tl.float32) * bin_floor, axis=0) < top_p * total).to(tl.int32), axis=0) + 1
    short_k = tl.sum((cum_counts.to(tl.float32) < top_k).to(tl.int32), axis=0) + 1
    short = tl.maximum(tl.where(top_p < 1.0, short_p, 0), tl.where(top_k < vocab, short_k, 0))
    short_count = tl.sum(tl.where(tl.arange(0, BINS) == short - 1, cum_counts, 0), axis=0)
    use_short = (short >= 1) & (short < BINS) & (short_count <= SMALL)
    return tl.where(use_short, short, fit)


@triton.jit
def _scale_kernel(logits_ptr, seen_ptr, new_ptr, rng_ptr, table_ptr, x_ptr, pmax_ptr, pid_ptr, psum_ptr, vocab,
                  stride_l, stride_s, stride_t, MARK: tl.constexpr, SEEDED: tl.constexpr, SLICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * vocab can pass 2**31 in a large batch
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    if SEEDED:  # one more draw under this seed: the later kernels key their noise by the count
        if (row == 0) & (part == 0):
            tl.store(rng_ptr + 1, tl.load(rng_ptr + 1) + 1)
    t = table_ptr + row * stride_t  # RowTable.columns: 1/T, penalty, 1/penalty, top_k, top_p, min_p, greedy, filtered
    inv_temp = tl.load(t)
    seen_factor = tl.load(t + 2) * inv_temp
    seen_neg_factor = tl.load(t + 1) * inv_temp
    offs = part * SLICE + tl.arange(0, SLICE)
    inside = offs < vocab
    raw = tl.load(logits_ptr + row * stride_l + offs, mask=inside, other=-float("inf")).to(tl.float32)
    seen = tl.load(seen_ptr + row * stride_s + offs, mask=inside, other=0)
    if MARK:  # the row's new token (a flat index into the masks; past them: none), marked before it is read
        fresh = inside & (offs == tl.load(new_ptr + row) - row * stride_s)
        tl.store(seen_ptr + row * stride_s + offs, tl.full((SLICE,), 1, tl.uint8), mask=fresh)
        seen = tl.where(fresh, 1, seen)
    factor = tl.where(seen != 0, tl.where(raw > 0, seen_factor, seen_neg_factor), inv_temp)
    x = raw * factor
    tl.store(x_ptr + row * vocab + offs, x, mask=inside)
    top = tl.max(x, axis=0)
    first = tl.min(tl.where(x == top, offs, 2147483647), axis=0)
    total = tl.sum(tl.where(x > -float("inf"), tl.exp(x - top), 0.0), axis=0)
    tl.store(pmax_ptr + row * parts + part, top)
    tl.store(pid_ptr + row * parts + part, first)
    tl.store(psum_ptr + row * parts + part, total)


@triton.jit
def _count_kernel(table_ptr, x_ptr, pmax_ptr, counts_ptr, vocab, stride_t, FILTERED: tl.constexpr,
                  SLICE: tl.constexpr, PB: tl.constexpr, BINS: tl.constexpr, BIN_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * vocab can pass 2**31 in a large batch
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    if _skips(table_ptr + row * stride_t, FILTERED):
        return
    p = tl.arange(0, PB)
    top = tl.max(tl.load(pmax_ptr + row * parts + p, mask=p < parts, other=-float("inf")), axis=0)
    offs = part * SLICE + tl.arange(0, SLICE)
    inside = offs < vocab
    x = tl.load(x_ptr + row * vocab + offs, mask=inside, other=-float("inf"))
    bins = _bins(x, top, BINS, BIN_SCALE)
    # the catch-all last bin is never a candidate: left uncounted (most of a vocabulary lies far below the max)
    counts = tl.histogram(bins, BINS, mask=inside & (bins < BINS - 1))
    tl.store(counts_ptr + (row * parts + part) * BINS + tl.arange(0, BINS), counts)


@triton.jit
def _gather_kernel(table_ptr, x_ptr, pmax_ptr, pid_ptr, psum_ptr, counts_ptr, cand_ptr, count_ptr, vocab, stride_t,
                   FILTERED: tl.constexpr, SLICE: tl.constexpr, PB: tl.constexpr, CAND: tl.constexpr,
                   SMALL: tl.constexpr, BINS: tl.constexpr, BIN_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * vocab can pass 2**31 in a large batch
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    t = table_ptr + row * stride_t
    if _skips(t, FILTERED):
        return
    top, _, total = _row_top(pmax_ptr, pid_ptr, psum_ptr, row, parts, PB)
    p = tl.arange(0, PB)
    b = tl.arange(0, BINS)
    per_slice = _slice_counts(counts_ptr, row, parts, PB, BINS)
    fit = _fit(tl.sum(per_slice, axis=0), total, tl.load(t + 3), tl.load(t + 4), vocab, CAND, SMALL, BINS, BIN_SCALE)
    base = tl.sum(tl.sum(tl.where((p < part)[:, None] & (b < fit)[None, :], per_slice, 0), axis=1), axis=0)
    offs = part * SLICE + tl.arange(0, SLICE)
    x = tl.load(x_ptr + row * vocab + offs, mask=offs < vocab, other=-float("inf"))
    take = (offs < vocab) & (_bins(x, top, BINS, BIN_SCALE) < fit)
    slot = base + tl.cumsum(take.to(tl.int32), axis=0) - 1
    packed = (order_key(x) << 32) | (2147483647 - offs).to(tl.int64)
    tl.store(cand_ptr + row * CAND + slot, packed, mask=take)
    if part == 0:
        tl.store(count_ptr + row, tl.sum(tl.sum(tl.where((b < fit)[None, :], per_slice, 0), axis=1), axis=0))


@triton.jit
def _rank_kernel(table_ptr, cand_ptr, count_ptr, sorted_ptr, stride_t, FILTERED: tl.constexpr, CAND: tl.constexpr,
                 RB: tl.constexpr, RJ: tl.constexpr):
    """Each program places RB of the row's candidates in descending order: a candidate's rank is the number
    of candidates with a larger key (the keys are distinct: they hold the id), so the row's programs together
    write the sorted list that one program's `tl.sort` would, each reading the row's candidates once."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    if _skips(table_ptr + row * stride_t, FILTERED):
        return
    count = tl.load(count_ptr + row)
    if block * RB >= count:
        return
    i = block * RB + tl.arange(0, RB)
    mine = i < count
    cand_row = cand_ptr + row * CAND
    key = tl.load(cand_row + i, mask=mine, other=0)
    larger = tl.zeros((RB, RJ), tl.int32)
    for start in tl.static_range(0, CAND, RJ):
        if start < count:
            j = start + tl.arange(0, RJ)
            other = tl.load(cand_row + j, mask=j < count, other=-9223372036854775807 - 1)
            larger += (other[None, :] > key[:, None]).to(tl.int32)
    tl.store(sorted_ptr + row * CAND + tl.sum(larger, axis=1), key, mask=mine)


@triton.jit
def _race_kernel(table_ptr, x_ptr, noise_ptr, rng_ptr, pmax_ptr, pid_ptr, psum_ptr, sorted_ptr, count_ptr, ids_ptr,
                 need_ptr, lse_ptr, pmin_ptr, top_p_ptr, top_k_ptr, vocab, parts, stride_t, stride_n,
                 FILTERED: tl.constexpr, SEEDED: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, PB: tl.constexpr,
                 CAND: tl.constexpr, SMALL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * vocab can pass 2**31 in a large batch
    t = table_ptr + row * stride_t
    top, top_id, total = _row_top(pmax_ptr, pid_ptr, psum_ptr, row, parts, PB)
    lse = top + tl.log(total)
    min_p = tl.load(t + 5)
    top_k = tl.load(t + 3)
    top_p = tl.load(t + 4)
    tl.store(lse_ptr + row, lse)
    tl.store(pmin_ptr + row, min_p * tl.exp(top - lse))
    tl.store(top_p_ptr + row, top_p)  # the fallback's parameters, contiguous
    tl.store(top_k_ptr + row, top_k)
    greedy = tl.load(t + 6) > 0
    filtered = tl.load(t + 7) > 0
    noise_row = noise_ptr + row * stride_n
    if FILTERED:
        _race_candidates(sorted_ptr, count_ptr, noise_row, rng_ptr, ids_ptr, need_ptr, row, top, total, top_k, top_p,
                         min_p, vocab, CAND, SMALL, SEEDED)
    elif greedy:
        tl.store(ids_ptr + row, top_id)
        tl.store(need_ptr + row, 0)
    elif filtered:
        _race_candidates(sorted_ptr, count_ptr, noise_row, rng_ptr, ids_ptr, need_ptr, row, top, total, top_k, top_p,
                         min_p, vocab, CAND, SMALL, SEEDED)
    else:  # neither top-k nor top-p: race over the whole vocabulary (min-p applied), as race_full does
        lane_best = tl.full((BLOCK,), -2.0, tl.float32)
        lane_id = tl.zeros((BLOCK,), tl.int32)
        for nb in range(NB):
            offs = nb * BLOCK + tl.arange(0, BLOCK)
            inside = offs < vocab
            x = tl.load(x_ptr + row * vocab + offs, mask=inside, other=-float("inf"))
            e = tl.load(noise_row + offs, mask=inside, other=1.0)  # never SEEDED (`sample_rows`)
            prob = tl.exp(x - top) / total
            prob = tl.where(prob < min_p * (1.0 / total), 0.0, prob)
            score = tl.where(inside, prob / e, -1.0)
            lane_id = tl.where(score > lane_best, offs, lane_id)
            lane_best = tl.maximum(lane_best, score)
        best = tl.max(lane_best, axis=0)
        best_id = tl.min(tl.where(lane_best == best, lane_id, 2147483647), axis=0).to(tl.int64)
        tl.store(ids_ptr + row, best_id)
        tl.store(need_ptr + row, 0)


@triton.jit
def _race_candidates(sorted_ptr, count_ptr, noise_row, rng_ptr, ids_ptr, need_ptr, row, top, total, top_k, top_p,
                     min_p, vocab, CAND: tl.constexpr, SMALL: tl.constexpr, SEEDED: tl.constexpr):
    """The row's draw from its candidates, which `_rank_kernel` sorted (their count from `_gather_kernel`)."""
    count = tl.load(count_ptr + row)
    if count <= SMALL:
        _race_sorted(sorted_ptr + row * CAND, noise_row, rng_ptr, row, ids_ptr + row, need_ptr + row, count, top,
                     total, top_k, top_p, min_p, vocab, SMALL, SEEDED)
    else:
        _race_sorted(sorted_ptr + row * CAND, noise_row, rng_ptr, row, ids_ptr + row, need_ptr + row, count, top,
                     total, top_k, top_p, min_p, vocab, CAND, SEEDED)


@triton.jit
def _race_sorted(cand_row, noise_row, rng_ptr, row, id_ptr, need_ptr, count, top, total, top_k, top_p, min_p, vocab,
                 N: tl.constexpr, SEEDED: tl.constexpr):
    """Race the `count` (<= N) packed candidates, sorted descending, as `sampling_filters._race_prefiltered`."""
    ranks = tl.arange(0, N)
    valid = ranks < count
    packed = tl.load(cand_row + ranks, mask=valid, other=-9223372036854775807 - 1)
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
    noise = noise_at(noise_row, rng_ptr, row, ids, vocab, valid, SEEDED)
    best = tl.argmax(tl.where(keep, p / noise, -1.0), axis=0)
    tl.store(id_ptr, tl.sum(tl.where(ranks == best, ids, 0), axis=0))
    tl.store(need_ptr, (~covered).to(tl.int32))


def sample_rows(logits: torch.Tensor, table: torch.Tensor, seen: torch.Tensor, noise: torch.Tensor | None,
                filtered: bool = False, slice_: int = SLICE, num_warps: int | None = None, race_warps: int = 8,
                rank: tuple[int, int, int] = (RANK_BLOCK, RANK_SWEEP, RANK_WARPS), *, new: torch.Tensor | None = None,
                out: torch.Tensor | None = None, offset: int = 0, rng: torch.Tensor | None = None) -> torch.Tensor:
    """Ids [N] (columns of `logits`) drawn from float32 `logits` [N, V] as `sampling.sample_static`
    draws them: `table` [N, C] float32 `RowTable.columns` rows, `seen` [N, V] bool seen-token masks
    (contiguous rows), Exp(1) `noise` [N, V]; `filtered`: every row samples under top-k or top-p. Rows
    whose nucleus reaches past the candidates are redrawn over the whole vocabulary by `nucleus.nucleus_race_`.
    `new` (int64 [N]): flat indexes into `seen` (row * V + column; N * V or more: none) marked seen first.
    `out` (int64 [N]): where the ids go instead, each clamped into [0, V) and plus `offset`.
    `rng` (int64 [2] on the device: seed, draws so far; `filtered` only) instead of `noise`: the noise is
    philox's under the key seed + draws (`nucleus.exp_noise`), made where a kernel reads it, and the
    call counts one more draw on the device.
    Six launches (`slice_` ids a program, more where a row would take over MAX_PARTS programs; `num_warps`
    each, None: 4 up to 2,048 ids, else 8; the race `race_warps`; the rank kernel's `rank`: candidates a
    program, candidates compared at a time, warps), no host sync (CUDA-graph capturable)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and seen.stride(1) == 1 and table.stride(1) == 1
    assert seen.shape == logits.shape and table.shape[0] == rows
    if rng is None:
        assert noise is not None and noise.shape == logits.shape and noise.stride(1) == 1
    else:  # the noise of unfiltered rows, read over whole rows by one program, is better made by one launch
        assert noise is None and filtered and rng.dtype == torch.int64 and rng.numel() == 2
        assert rows * vocab < 2**31, "exp_noise counts a draw's elements in int32"
    slice_ = max(slice_, triton.next_power_of_2(triton.cdiv(vocab, MAX_PARTS)))  # wide rows: wider slices
    parts = triton.cdiv(vocab, slice_)
    num_warps = num_warps or (4 if slice_ <= 2048 else 8)
    device = logits.device
    x = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    pmax = torch.empty(rows, parts, dtype=torch.float32, device=device)
    pid = torch.empty(rows, parts, dtype=torch.int32, device=device)
    psum = torch.empty(rows, parts, dtype=torch.float32, device=device)
    counts = torch.empty(rows, parts, BINS, dtype=torch.int32, device=device)
    cand, ordered = torch.empty(2, rows, CANDIDATES, dtype=torch.int64, device=device)
    count = torch.empty(rows, dtype=torch.int32, device=device)
    ids = torch.empty(rows, dtype=torch.int64, device=device)
    need = torch.empty(rows, dtype=torch.int32, device=device)
    lse, pmin, top_p, top_k = torch.empty(4, rows, dtype=torch.float32, device=device)
    if not rows:
        return ids if out is None else out
    pb = triton.next_power_of_2(parts)
    assert seen.stride(0) == vocab or new is None, "marking needs the masks' rows back to back"
    _scale_kernel[(rows, parts)](logits, seen.view(torch.uint8), seen if new is None else new,
                                 table if rng is None else rng, table, x, pmax, pid, psum, vocab, logits.stride(0),
                                 seen.stride(0), table.stride(0), MARK=new is not None, SEEDED=rng is not None,
                                 SLICE=slice_, num_warps=num_warps)
    consts = dict(FILTERED=filtered, SLICE=slice_, PB=pb, BINS=BINS, BIN_SCALE=BIN_SCALE, num_warps=num_warps)
    _count_kernel[(rows, parts)](table, x, pmax, counts, vocab, table.stride(0), **consts)
    _gather_kernel[(rows, parts)](table, x, pmax, pid, psum, counts, cand, count, vocab, table.stride(0),
                                  CAND=CANDIDATES, SMALL=FEW_CANDIDATES, **consts)
    rank_block, rank_sweep, rank_warps = rank
    _rank_kernel[(rows, CANDIDATES // rank_block)](table, cand, count, ordered, table.stride(0), FILTERED=filtered,
                                                   CAND=CANDIDATES, RB=rank_block, RJ=rank_sweep, num_warps=rank_warps)
    block = min(triton.next_power_of_2(vocab), 4096)
    noise_in = logits if noise is None else noise  # with rng: a stand-in pointer, never read
    _race_kernel[(rows,)](table, x, noise_in, table if rng is None else rng, pmax, pid, psum, ordered, count, ids, need,
                          lse, pmin, top_p, top_k, vocab, parts, table.stride(0), noise_in.stride(0), FILTERED=filtered,
                          SEEDED=rng is not None, NB=triton.cdiv(vocab, block), BLOCK=block, PB=pb, CAND=CANDIDATES,
                          SMALL=FEW_CANDIDATES, num_warps=race_warps)
    return nucleus_race_(x, noise, ids, need, lse, top_p, pmin, top_k=top_k, out=out, offset=offset, rng=rng)
