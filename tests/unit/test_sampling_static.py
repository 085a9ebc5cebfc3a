"""`sample_static` (the branch-free draw the sampling CUDA graphs capture) gives every row the token
`sample` gives it for the same noise, and `graphable` says which rows it may serve."""

from __future__ import annotations

import pytest
import torch

import mstar.engines.sampling_filters as filters
from mstar.engines.sampling import SamplingParams, SamplingRow, graphable, sample, sample_static

MIXES = {
    "orpheus": [SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3)] * 4,
    "mixed": [SamplingParams(temperature=0.0), SamplingParams(top_p=0.8), SamplingParams(top_k=7, temperature=0.7),
              SamplingParams(top_k=12, top_p=0.9, repetition_penalty=1.2), SamplingParams(),
              SamplingParams(min_p=0.1, temperature=1.3), SamplingParams(temperature=0.0, repetition_penalty=1.5),
              SamplingParams(top_p=0.3, min_p=0.05, repetition_penalty=0.8)],
    "unfiltered": [SamplingParams(temperature=0.9), SamplingParams(temperature=0.0)],
}


@pytest.mark.parametrize("prefilter", [16, 1024])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_static_draw_equals_sample(monkeypatch, mix, prefilter):
    """Same global seed, same noise: the same ids. A 16-wide prefilter sends most top-p rows to the
    whole-vocabulary fallback, so both paths of `pick` are compared."""
    monkeypatch.setattr(filters, "PREFILTER_K", prefilter)
    params = MIXES[mix]
    gen = torch.Generator().manual_seed(len(mix) + prefilter)
    vocab = 500
    for trial in range(6):
        rows = [SamplingRow(p, torch.randint(0, vocab, (20 + trial,), generator=gen).tolist(), 12) for p in params]
        assert all(graphable(r) for r in rows)
        logits = torch.randn(len(rows), vocab, generator=gen) * (0.5 + trial)
        table = filters.RowTable.columns(rows, vocab)
        seen = filters.seen_masks(rows, vocab, logits.device)
        torch.manual_seed(trial)
        expected = sample(logits, rows).token_ids
        torch.manual_seed(trial)
        got = sample_static(logits, table, seen)
        assert got.tolist() == expected.tolist(), (mix, trial)


def test_static_draw_reads_seen_masks_only_for_penalised_rows():
    vocab = 50
    logits = torch.randn(2, vocab)
    rows = [SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.0), [0], 1),
            SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=100.0), [0], 1)]
    logits[:, 3] = 10.0  # the argmax of both rows
    seen = torch.zeros(2, vocab, dtype=torch.bool)
    seen[:, 3] = True  # token 3 seen: only the penalised row must move off it
    ids = sample_static(logits, filters.RowTable.columns(rows, vocab), seen)
    assert ids[0] == 3 and ids[1] != 3


@pytest.mark.parametrize(("params", "generator", "ok"), [
    (SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3), False, True),
    (SamplingParams(top_k=1024), False, True),
    (SamplingParams(top_k=1025), False, False),  # wider than the prefilter
    (SamplingParams(seed=3), True, False),
    (SamplingParams(logprobs=0), False, False),
    (SamplingParams(presence_penalty=0.5), False, False),
    (SamplingParams(frequency_penalty=0.5), False, False),
    (SamplingParams(min_tokens=5), False, False),  # eos banned for now
])
def test_graphable(params, generator, ok):
    row = SamplingRow(params, [1, 2, 3], 3, torch.Generator() if generator else None, eos_token_ids=(7,))
    assert graphable(row) is ok


def test_min_tokens_reached_is_graphable():
    row = SamplingRow(SamplingParams(min_tokens=2), [1, 2, 3, 4, 5], 3, eos_token_ids=(7,))
    assert graphable(row)


def test_sampler_graphs_table_follows_the_rows(monkeypatch):
    """SamplerGraphs keeps the parameter table while the batch's params stay the same; any change of
    rows (other params, another order, fewer rows) gets the table of the new rows. Run on the CPU
    with the captured graph replaced by `sample_static` itself (no CUDA graph, no pinned memory)."""
    from mstar.engines.sampling_graph import SamplerGraphs

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    vocab, tables = 300, []
    sampler = SamplerGraphs([8], torch.device("cpu"))
    sampler._vocab, sampler._unseen = vocab, torch.zeros(8, vocab, dtype=torch.bool)

    def replay(logits, table, seen):
        tables.append(table)
        return (sample_static(logits, table, seen),)

    sampler._graphs = replay
    a, b, c = (SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3),
               SamplingParams(temperature=0.0), SamplingParams(top_k=5, temperature=1.2))
    gen = torch.Generator().manual_seed(0)

    def rows(*params):
        return [SamplingRow(p, torch.randint(0, vocab, (6,), generator=gen).tolist(), 3) for p in params]

    batches = [[a, b, c], [a, b, c], [b, a, c], [a, c], [a, c], [SamplingParams(top_k=5, temperature=1.2), a]]
    for params in batches:
        batch = rows(*params)
        ids = sampler(torch.randn(len(batch), vocab, generator=gen), batch)
        assert ids is not None and ids.shape == (len(batch),)
        assert torch.equal(tables[-1], filters.RowTable.columns(batch, vocab))
    assert tables[0] is tables[1] and tables[3] is tables[4]  # same params, same order: kept
    assert tables[2] is not tables[1] and tables[3] is not tables[2] and tables[5] is not tables[4]
