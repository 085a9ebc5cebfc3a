"""Run under TRITON_INTERPRET=1 by test_sampling_filters.py: the fused prefilter race kernel
(`kernels/nucleus.prefilter_race_`) returns the ids, coverage and log-normaliser of the PyTorch
`_race_prefiltered` for rows with top-p, top-k, min-p, none of them, banned tokens, -inf outside a span
of 40 ids (a restricted head) and a vocabulary smaller than the prefilter (prints "prefilter ok")."""

import torch

import mstar.engines.sampling_filters as filters
from mstar.engines.sampling import SamplingParams, SamplingRow
from mstar.kernels.nucleus import prefilter_race_

COLUMNS = (filters.TOP_K_COLUMN, filters.TOP_P_COLUMN, filters.MIN_P_COLUMN)
PARAMS = [SamplingParams(temperature=0.6, top_p=0.8), SamplingParams(top_k=7), SamplingParams(top_k=30, top_p=0.5),
          SamplingParams(top_p=0.95, min_p=0.05), SamplingParams(min_p=0.2), SamplingParams(),
          SamplingParams(top_p=0.3), SamplingParams(top_k=64, top_p=0.99, min_p=0.01)]


def check(vocab: int, prefilter: int, seed: int) -> int:
    filters.PREFILTER_K = prefilter
    gen = torch.Generator().manual_seed(seed)
    rows = [SamplingRow(p, [1, 2, 3], 3) for p in PARAMS]
    x = torch.randn(len(rows), vocab, generator=gen) * torch.linspace(0.3, 6.0, len(rows))[:, None]
    x[3, : vocab // 4] = -float("inf")  # banned tokens
    span = torch.zeros(vocab, dtype=torch.bool)  # a head restricted to 40 ids, 3 of them blocked
    span[vocab // 3 : vocab // 3 + 40] = True
    span[vocab // 3 + 1 : vocab // 3 + 4] = False
    x[0, ~span] = -float("inf")  # Orpheus' defaults, as with audio_logits_only
    x[6, ~span] = -float("inf")
    noise = torch.empty_like(x).exponential_(generator=gen)
    table = filters.RowTable(rows, vocab, x.device)
    ids, covered, lse, vals = filters._race_prefiltered(x, table, noise)
    k = vals.shape[1]
    idx = x.topk(k, dim=-1).indices
    total = (x - vals[:, :1]).exp().sum(dim=-1)
    got_ids, got_covered, got_lse = prefilter_race_(vals, idx, total, table.table, noise, vocab, COLUMNS)
    assert got_ids.tolist() == ids.tolist(), (vocab, prefilter, seed, got_ids, ids)
    assert bool(x.gather(1, got_ids[:, None]).isfinite().all()), (vocab, prefilter, seed, got_ids)
    assert got_covered.tolist() == covered.tolist(), (vocab, prefilter, seed, got_covered, covered)
    torch.testing.assert_close(got_lse, lse[:, 0], rtol=1e-6, atol=1e-6)
    return int(covered.sum())


covered = [check(vocab, prefilter, seed) for vocab, prefilter in ((700, 64), (700, 256), (50, 64)) for seed in range(3)]
assert 0 < sum(covered) < 8 * len(covered), covered  # both covered rows and rows left to the fallback were seen
print("prefilter ok")
