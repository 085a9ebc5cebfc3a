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
    "filtered": [SamplingParams(top_p=0.8), SamplingParams(top_k=7, temperature=0.7),
                 SamplingParams(top_k=12, top_p=0.9, repetition_penalty=1.2),
                 SamplingParams(top_p=0.3, min_p=0.05, repetition_penalty=0.8)],
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
        if all(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0) for p in params):
            torch.manual_seed(trial)  # the variant without the greedy and unfiltered stages
            assert sample_static(logits, table, seen, filtered=True).tolist() == expected.tolist(), (mix, trial)


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
    """SamplerGraphs stages each call's parameter table in the packed inputs: it equals the rows' table
    whatever the batch (other params, another order, fewer rows), and a host set rebuilds it only when
    the params changed. Run on the CPU with the graph run eagerly (tests/unit/graph_standins.py)."""
    from mstar.engines import sampling_graph
    from mstar.engines.sampling_graph import SamplerGraphs
    from tests.unit.graph_standins import EagerBatchGraphs

    tables, builds, used = [], [], []
    build = filters.RowTable.columns

    class Recording(EagerBatchGraphs):
        def __call__(self, logits, table, new, bucket=None):
            tables.append(table.clone())
            used.append(self)
            return super().__call__(logits, table, new, bucket=bucket)

    def counted(rows, vocab):
        builds.append(len(rows))
        return build(rows, vocab)

    monkeypatch.setattr(sampling_graph, "BatchGraphs", Recording)
    monkeypatch.setattr(sampling_graph.RowTable, "columns", staticmethod(counted))
    vocab = 300
    sampler = SamplerGraphs([2, 4, 8], torch.device("cpu"))
    a, b, c = (SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3),
               SamplingParams(temperature=0.0), SamplingParams(top_k=5, temperature=1.2))
    gen = torch.Generator().manual_seed(0)

    def rows(*params):
        return [SamplingRow(p, torch.randint(0, vocab, (6,), generator=gen).tolist(), 3) for p in params]

    batches = [[a, b, c]] * 3 + [[b, a, c], [a, c], [a, c], [a, c], [SamplingParams(top_k=5, temperature=1.2), a]]
    steady = []
    for params in batches:
        batch = rows(*params)
        before = len(builds)
        ids = sampler(torch.randn(len(batch), vocab, generator=gen), batch)
        assert ids is not None and ids.shape == (len(batch),)
        assert torch.equal(tables[-1], build(batch, vocab))
        steady.append(len(builds) - before)
        # a greedy row (b) needs the general graphs; rows all under top-p or top-k take the filtered ones
        assert used[-1] is sampler._graphs[b not in params]
    # each of the two host sets builds a batch's table once; the third call of the same params builds none
    assert steady == [1, 1, 0, 1, 1, 1, 0, 1]


@pytest.mark.parametrize("offset", [0, 7])
def test_seen_rows_follow_any_history(offset):
    """SeenRows (the sampler graphs' seen-token masks) over random histories: steady steps, several new
    tokens, restarts, tokens past the vocabulary, joins, leaves and reorders, sequences coming back
    after their row was taken, and eager `seen_masks` calls in between. After `mark` and the replay's
    marking (index_fill_ of the indexes it wrote), every row is exactly its sequence's tokens: token t
    at column t - offset (logits of the ids [offset, offset + vocab); ids before the window too)."""
    import random

    import numpy as np

    from mstar.engines.sampling_graph import SeenRows

    rng = random.Random(0)
    vocab, rows_max, cpu = 40, 5, torch.device("cpu")
    seen = SeenRows(rows_max, vocab, cpu, offset)
    seqs = [SamplingRow(SamplingParams(repetition_penalty=1.3), [rng.randrange(offset + vocab) for _ in range(3)],
                        3, cache={}) for _ in range(9)]
    batch = seqs[:3]

    def want(row):
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[[t - offset for t in row.token_ids if offset <= t < offset + vocab]] = True
        return mask

    for step in range(600):
        r = rng.random()
        if r < 0.15:
            batch = rng.sample(seqs, rng.randrange(1, rows_max + 1))  # joins, leaves, reorders
        for row in batch:
            u = rng.random()
            if u < 0.8:
                row.token_ids.append(rng.randrange(offset + vocab + 3))  # now and then past the vocabulary
            elif u < 0.9:
                row.token_ids.extend(rng.randrange(offset + vocab) for _ in range(rng.randrange(2, 5)))
            elif u < 0.93 and len(row.token_ids) > 1:
                del row.token_ids[rng.randrange(1, len(row.token_ids)):]  # restarted shorter
        if rng.random() < 0.1:  # an eager step between graph steps
            masks = filters.seen_masks(batch, vocab, cpu, offset)
            for i, row in enumerate(batch):
                assert torch.equal(masks[i], want(row)), step
            continue
        bucket = rng.choice([b for b in (1, 2, 4, 5) if b >= len(batch)])
        new = np.full(rows_max, -7, dtype=np.int64)
        seen.mark(batch, new, bucket)
        assert (new[len(batch):bucket] == seen.trash).all() and (new[bucket:] == -7).all()
        seen.flat.index_fill_(0, torch.from_numpy(new[:bucket].copy()), True)  # what the replay does
        for i, row in enumerate(batch):
            assert torch.equal(seen.masks[i], want(row)), (step, i)


@pytest.mark.parametrize("prefilter", [16, 1024])
def test_static_draw_over_minus_inf_logits(monkeypatch, prefilter):
    """Logits of a head restricted to a span: `sample_static`, general and filtered, draws only finite
    ids, the ones `sample` draws for the same noise."""
    from tests.unit.test_sampling import SPAN, SPAN_PARAMS, SPEAKABLE, VOCAB, span_logits

    monkeypatch.setattr(filters, "PREFILTER_K", prefilter)
    # those `sample_static` serves (top_k 200 only over the wide prefilter)
    params = [q for p in SPAN_PARAMS[:5] if (q := SamplingParams(**p)).static_ok]
    gen = torch.Generator().manual_seed(prefilter)
    for trial in range(10):
        for chosen in (params, [p for p in params if p.temperature > 0 and (p.top_k or p.top_p < 1)]):
            tokens = [5, 302, *torch.randint(SPAN[0], SPAN[1], (trial + 1,), generator=gen).tolist()]
            rows = [SamplingRow(p, tokens, 2) for p in chosen]
            assert all(graphable(r) for r in rows) and len(rows) >= 2
            logits = span_logits(len(rows), gen, 0.5 + trial % 5)
            table = filters.RowTable.columns(rows, VOCAB)
            seen = filters.seen_masks(rows, VOCAB, logits.device)
            torch.manual_seed(trial)
            expected = sample(logits, rows).token_ids
            torch.manual_seed(trial)
            got = sample_static(logits, table, seen, filtered=chosen is not params)
            assert got.tolist() == expected.tolist() and set(got.tolist()) <= SPEAKABLE, (trial, len(chosen))


def test_sampler_graphs_over_a_window_hand_back_token_ids(monkeypatch):
    """SamplerGraphs(offset=...) over logits of the ids [500, 560), steps after steps: the ids `sample`
    gives the same rows for the same global seed (the replay marks each row's new token at its column;
    ids outside the window are left out), as token ids."""
    from mstar.engines import sampling_graph
    from mstar.engines.sampling_graph import SamplerGraphs
    from tests.unit.graph_standins import EagerBatchGraphs

    monkeypatch.setattr(sampling_graph, "BatchGraphs", EagerBatchGraphs)
    offset, width = 500, 60
    sampler = SamplerGraphs([2, 4], torch.device("cpu"), offset)
    params = [SamplingParams(temperature=0.0, repetition_penalty=3.0), *MIXES["orpheus"][:3]]
    gen = torch.Generator().manual_seed(3)
    history = [[7, 499, 560, 900, *torch.randint(offset, offset + width, (3,), generator=gen).tolist()]
               for _ in params]
    graph_rows = [SamplingRow(p, h, 4, cache={}) for p, h in zip(params, history)]
    for step in range(12):
        logits = torch.randn(len(params), width, generator=gen) * 3
        torch.manual_seed(step)
        got = sampler(logits, graph_rows)
        torch.manual_seed(step)
        want = sample(logits, [SamplingRow(p, list(h), 4) for p, h in zip(params, history)], offset)
        assert got is not None and got.tolist() == want.token_ids.tolist(), step
        assert all(offset <= t < offset + width for t in got.tolist())
        for h, t in zip(history, got.tolist()):
            h.append(t if step % 3 else t + width)  # now and then an id past the window is fed back
    assert sampler.replays == 12
