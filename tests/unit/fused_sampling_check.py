"""Run under TRITON_INTERPRET=1 by test_sampling_filters.py: `kernels/fused_sampling.sample_rows` draws
the ids `sampling.sample_static`'s PyTorch form draws for the same noise: greedy, unfiltered, top-k,
top-p and min-p rows, repetition penalties, -inf outside a span or where a structured output's token mask
forbids, peaked rows (covered by the candidates), flat ones (left to the whole-vocabulary bisection, top-k
rows too), and the variant for all-filtered batches (prints "fused sampling ok"). With --quick, one mixed
batch, one all-filtered batch and one masked mixed batch (the default test run)."""

import sys

import torch
import triton
import triton.language as tl

import mstar.engines.sampling_filters as filters
from mstar.engines.sampling import SamplingParams, SamplingRow, sample_static
from mstar.kernels.fused_sampling import CANDIDATES, RANK_BLOCK, RANK_SWEEP, _rank_kernel, sample_rows
from mstar.kernels.nucleus import exp_noise

MIXED = [SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3), SamplingParams(temperature=0.0),
         SamplingParams(top_k=7, temperature=0.7), SamplingParams(top_k=12, top_p=0.9, repetition_penalty=1.2),
         SamplingParams(), SamplingParams(min_p=0.1, temperature=1.3),
         SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(top_p=0.3, min_p=0.05)]
FILTERED = [p for p in MIXED if p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0)]


def ranked(counts: list[int]) -> None:
    """`_rank_kernel` writes each row's first `count` keys in descending order."""
    gen = torch.Generator().manual_seed(5)
    rows = len(counts)
    # as `_gather_kernel` packs them: a value (few distinct ones, so ties are many) over the id's complement
    values = torch.randint(-20, 20, (rows, CANDIDATES), generator=gen)
    keys = (values << 32) | (2147483647 - torch.randperm(CANDIDATES, generator=gen).expand(rows, -1))
    count = torch.tensor(counts, dtype=torch.int32)
    ordered = torch.zeros_like(keys)
    table = torch.zeros(rows, 8)  # not read: the FILTERED variant serves every row
    _rank_kernel[(rows, CANDIDATES // RANK_BLOCK)](table, keys, count, ordered, table.stride(0), FILTERED=True,
                                                   CAND=CANDIDATES, RB=RANK_BLOCK, RJ=RANK_SWEEP)
    for r, n in enumerate(counts):
        assert ordered[r, :n].tolist() == keys[r, :n].sort(descending=True).values.tolist(), (r, n)


def check(params: list[SamplingParams], vocab: int, scale: float, seed: int, filtered: bool,
          live: int | None = None, allowed: list[int | None] | None = None) -> list[int]:
    """`live`: only the first `live` ids of each row are finite (the window of a windowed head). `allowed`: per
    row, how many ids scattered past the first third a structured output's token mask leaves finite (None:
    all); every id drawn is one of them."""
    gen = torch.Generator().manual_seed(seed)
    rows = [SamplingRow(p, torch.randint(0, vocab, (30,), generator=gen).tolist(), 10) for p in params]
    logits = torch.randn(len(rows), vocab, generator=gen) * scale
    logits[0, : vocab // 3] = -float("inf")  # a head restricted to a span
    if live is not None:
        logits[:, live:] = -float("inf")
    for i, count in enumerate(allowed or []):
        if count is not None:
            keep = vocab // 3 + torch.randperm(vocab - vocab // 3, generator=gen)[:count]
            logits[i] = torch.full((vocab,), -float("inf")).index_copy(0, keep, logits[i, keep])
    table = filters.RowTable.columns(rows, vocab)
    seen = filters.seen_masks(rows, vocab, logits.device)
    torch.manual_seed(seed)
    noise = torch.empty_like(logits).exponential_()
    torch.manual_seed(seed)
    expected = sample_static(logits, table, seen, filtered)  # on CPU: the PyTorch form, with the same noise
    got = sample_rows(logits, table, seen, noise, filtered, slice_=256)
    assert got.tolist() == expected.tolist(), (vocab, scale, seed, filtered, got, expected)
    assert bool(logits[torch.arange(len(rows)), got].isfinite().all()), (got, allowed)
    return got.tolist()


def marked_and_finished() -> None:
    """With `new` and `out` (as the sampler graphs call it): the rows' new tokens are marked seen before the
    penalty reads them (the same ids as marking first, then drawing), and every row's id lands in `out`
    plus the offset (a padding row with an all-zero table row included; its draw is in range here, so the
    clamp is not exercised)."""
    vocab, gen = 700, torch.Generator().manual_seed(6)
    params = [SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3)] * 3
    rows = [SamplingRow(p, torch.randint(0, vocab, (30,), generator=gen).tolist(), 10) for p in params]
    logits = torch.randn(4, vocab, generator=gen) * 2.0
    table = torch.cat([filters.RowTable.columns(rows, vocab), torch.zeros(1, filters.COLUMNS)])
    flat = torch.zeros(4 * vocab + 1, dtype=torch.bool)
    seen = flat[: 4 * vocab].view(4, vocab)
    seen[:3] = filters.seen_masks(rows, vocab, logits.device)
    top = logits.argmax(dim=1)  # the new tokens: each row's likeliest, which the penalty then pushes down
    new = torch.tensor([0 * vocab + top[0], 1 * vocab + top[1], 4 * vocab, 3 * vocab + 5])  # row 2: none
    noise = torch.empty_like(logits).exponential_(generator=gen)
    expected_seen = flat.clone()
    expected_seen.index_fill_(0, new, True)
    expected = sample_rows(logits, table, expected_seen[: 4 * vocab].view(4, vocab).clone(), noise, True, slice_=256)
    out = torch.full((4,), -1, dtype=torch.long)
    got = sample_rows(logits, table, seen, noise, True, new=new, out=out, offset=1000, slice_=256)
    masks = slice(0, 4 * vocab)  # the element past them is the sink of "none" (index_fill_ sets it, the kernel not)
    assert got is out and torch.equal(flat[masks], expected_seen[masks]), "marked as index_fill_ marks"
    assert out.tolist() == (expected.clamp(0, vocab - 1) + 1000).tolist(), (out, expected)


@triton.jit
def _field(out_ptr, key, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + row * vocab + cols, exp_noise(key, row, cols, vocab), mask=cols < vocab)


def noise_field(key: int, rows: int, vocab: int) -> torch.Tensor:
    """The Exp(1) noise a seeded draw under `key` reads, written out."""
    out = torch.empty(rows, vocab)
    _field[(rows, triton.cdiv(vocab, 512))](out, key, vocab, BLOCK=512)
    return out


def seeded(params: list[SamplingParams], vocab: int, scale: float) -> None:
    """With `rng` (seed, draws) the draw equals one with the noise field of key seed + draws written out; each
    call counts one draw on the device and so keys the next with the next key. Peaked rows race their
    candidates; flat rows (scale 0.4) are left to the whole-vocabulary fallback, which makes the same noise."""
    gen = torch.Generator().manual_seed(8)
    rows = [SamplingRow(p, torch.randint(0, vocab, (30,), generator=gen).tolist(), 10) for p in params]
    logits = torch.randn(len(rows), vocab, generator=gen) * scale
    table = filters.RowTable.columns(rows, vocab)
    seen = filters.seen_masks(rows, vocab, logits.device)
    rng = torch.tensor([123_456_789_012, 0])
    for draw in range(2):
        expected = sample_rows(logits, table, seen, noise_field(123_456_789_012 + draw, len(rows), vocab), True)
        assert sample_rows(logits, table, seen, None, True, rng=rng).tolist() == expected.tolist(), (vocab, draw)
        assert rng.tolist() == [123_456_789_012, draw + 1]
    field = noise_field(5, 1, 50_000)[0]  # Exp(1): mean 1, P(e > 1) = 1/e (both within ~4.5 standard errors)
    assert abs(field.mean().item() - 1) < 0.02 and abs((field > 1).float().mean().item() - 0.3679) < 0.01


def main() -> None:
    check(MIXED, 600, 2.0, 0, False)  # peaked: every filtered row is covered by the candidates
    check(FILTERED, 1500, 2.5, 2, True)
    # token masks of structured outputs; a top-k row with fewer finite ids than k is left to the fallback
    check(MIXED, 700, 2.0, 5, False, allowed=[None, 1, 2, 5, 40, 300, 1, 60])
    if "--quick" in sys.argv:
        return
    check(MIXED, 3000, 0.4, 6, False, allowed=[40, 2, 3, 7, 1, 300, 1, 60])  # flat rows under masks
    check(FILTERED, 2500, 0.4, 7, True, allowed=[1, 4, 3, 1000])
    check(MIXED, 3000, 0.4, 1, False)  # flat: top-p rows reach past the 1,024 candidates
    check([SamplingParams(top_k=40), SamplingParams(top_k=5, top_p=0.5)], 1500, 1e-4, 3, True)  # a flat top-k
    # Orpheus's defaults over a 4,096-id window of logits as flat as dummy weights give: hundreds of candidates
    check([FILTERED[0]] * 2, 6000, 1.1, 4, True, live=4096)
    ranked([1, 63, 64, 65, 700, 1024])
    marked_and_finished()
    seeded(FILTERED, 600, 2.0)
    seeded(FILTERED[:1], 3000, 0.4)


if __name__ == "__main__":
    main()
    print("fused sampling ok")
