"""Sampling on CUDA: no host sync in the Orpheus serving case, and the Triton nucleus race equals the
sort-based reference at the full Orpheus vocabulary."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import mstar.engines.sampling_filters as filters
from mstar.engines.sampling import SamplingParams, SamplingRow, sample
from mstar.engines.sampling_graph import SamplerGraphs
from mstar.kernels.nucleus import exp_noise, nucleus_race_

VOCAB = 156_940


def test_orpheus_sampling_never_syncs_the_stream():
    params = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3)
    logits = torch.randn(8, VOCAB, device="cuda") * 3
    caches = [{} for _ in range(8)]
    rows = [SamplingRow(params, list(range(i, i + 70)), 64, cache=caches[i]) for i in range(8)]
    sample(logits, rows)  # first call: builds the masks and compiles the kernel
    for r in rows:
        r.token_ids.append(5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.token_ids.shape == (8,)


def test_triton_nucleus_race_equals_sorted_reference_full_vocab():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(6, VOCAB, device="cuda", generator=gen) * torch.tensor([0.3, 1, 2, 4, 8, 1], device="cuda")[:, None]
    noise = torch.empty_like(x).exponential_(generator=gen)
    lse = x.logsumexp(-1)
    top_p = torch.tensor([0.8, 0.8, 0.5, 0.95, 0.9, 2.0], device="cuda")
    pmin = torch.zeros(6, device="cuda")
    ids = torch.zeros(6, dtype=torch.long, device="cuda")
    nucleus_race_(x, noise, ids, torch.ones(6, dtype=torch.bool, device="cuda"), lse, top_p, pmin)
    assert ids.tolist() == filters.race_sorted(x, top_p, pmin, lse, noise).tolist()


def test_sampler_graphs_draw_inside_the_nucleus_without_syncs():
    """Replays launch nothing that syncs, and every sampled token lies in its row's top-p nucleus of
    the penalised, tempered distribution (computed here by a full sort)."""
    params = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3)
    sampler = SamplerGraphs([1, 2, 4, 8], torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    # scale 2: nuclei of hundreds of tokens (at 4 a row's nucleus can be one or two tokens, which never vary)
    logits = torch.randn(5, VOCAB, device="cuda", generator=gen) * 2
    caches = [{} for _ in range(5)]
    rows = [SamplingRow(params, list(range(i, i + 70)), 64, cache=caches[i]) for i in range(5)]
    sampler(logits, rows)  # captures
    seen = filters.seen_masks(rows, VOCAB, logits.device)
    factor = torch.where(seen, torch.where(logits > 0, 1 / 1.3 / 0.6, 1.3 / 0.6), 1 / 0.6)
    probs = (logits * factor).softmax(-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    inside = torch.zeros_like(probs, dtype=torch.bool)
    inside.scatter_(1, order, sorted_p.cumsum(-1) - sorted_p < 0.8)
    draws = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(40):
            draws.append(sampler(logits, rows).clone())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    draws = torch.stack(draws)  # [40, 5]
    assert bool(inside.gather(1, draws.T).all())
    assert all(len(set(draws[:, i].tolist())) > 1 for i in range(5)), "40 draws from a wide nucleus never varied"
    assert sampler.replays == 41


@triton.jit
def _noise_field(out_ptr, key, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + row * vocab + cols, exp_noise(key, row, cols, vocab), mask=cols < vocab)


def test_filtered_sampler_graphs_draw_with_the_seeded_noise():
    """The filtered graphs make their noise in the kernels (philox under seed + draws, no generator in the
    graph): each replay draws what `sample_rows` draws with that noise written out, and counts one draw."""
    from mstar.kernels.fused_sampling import sample_rows

    vocab = 28_680
    params = SamplingParams(temperature=0.6, top_p=0.8)  # no penalty: the masks are not read
    sampler = SamplerGraphs([1, 2, 4], torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(2)
    logits = torch.randn(3, vocab, device="cuda", generator=gen) * torch.tensor([2.0, 1.0, 0.2], device="cuda")[:, None]
    rows = [SamplingRow(params, list(range(i, i + 20)), 10, cache={}) for i in range(3)]
    sampler(logits, rows)  # captures
    table = filters.RowTable.columns(rows, vocab).cuda()
    seen = torch.zeros(3, vocab, dtype=torch.bool, device="cuda")
    for _ in range(4):
        seed, draws = sampler.noise_state.tolist()
        field = torch.empty(3, vocab, device="cuda")
        _noise_field[(3, triton.cdiv(vocab, 1024))](field, seed + draws, vocab, BLOCK=1024)
        got = sampler(logits, rows).tolist()
        assert sampler.noise_state.tolist() == [seed, draws + 1]
        assert got == sample_rows(logits, table, seen, field, True).tolist()


def test_filtered_static_draw_equals_general_on_cuda():
    """The sampler graphs' `filtered` variant (no greedy, no whole-vocabulary race) draws the same ids as
    the general one for the same noise, at the Orpheus vocabulary, on rows covered by the prefilter
    and on rows that need the Triton nucleus fallback (flat logits)."""
    from mstar.engines.sampling import sample_static

    gen = torch.Generator(device="cuda").manual_seed(1)
    params = [SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3), SamplingParams(top_k=40),
              SamplingParams(temperature=1.1, top_p=0.95), SamplingParams(top_p=0.5, min_p=0.02)]
    rows = [SamplingRow(p, list(range(i, i + 50)), 40) for i, p in enumerate(params)]
    logits = torch.randn(len(rows), VOCAB, device="cuda", generator=gen) * torch.tensor(
        [3.0, 1.0, 0.05, 6.0], device="cuda")[:, None]  # row 2: nearly flat, outside any 1024-wide prefilter
    table = filters.RowTable.columns(rows, VOCAB).cuda()
    seen = filters.seen_masks(rows, VOCAB, logits.device)
    for trial in range(5):
        torch.manual_seed(trial)
        general = sample_static(logits, table, seen)
        torch.manual_seed(trial)
        assert sample_static(logits, table, seen, filtered=True).tolist() == general.tolist(), trial


@pytest.mark.parametrize("vocab", [28_680, 151_936])
def test_fused_sampling_equals_the_torch_form_on_cuda(monkeypatch, vocab):
    """`sample_static` on CUDA (kernels/fused_sampling.py, one launch plus the fallback's) draws what its
    PyTorch form draws for the same noise, general and filtered, on peaked rows, flat rows left to the
    whole-vocabulary bisection (top-k ones too), rows restricted to a span, greedy and unfiltered rows."""
    import mstar.engines.sampling as sampling

    gen = torch.Generator(device="cuda").manual_seed(vocab)
    params = [SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3), SamplingParams(top_k=40),
              SamplingParams(temperature=1.1, top_p=0.95), SamplingParams(top_p=0.5, min_p=0.02),
              SamplingParams(top_k=300, top_p=0.9), SamplingParams(temperature=0.0), SamplingParams(),
              SamplingParams(min_p=0.1, temperature=0.8)]
    rows = [SamplingRow(p, list(range(i, i + 50)), 40) for i, p in enumerate(params)]
    table = filters.RowTable.columns(rows, vocab).cuda()
    seen = filters.seen_masks(rows, vocab, torch.device("cuda"))
    for scale in (3.0, 0.3, 1e-4):  # peaked, flat (past the candidates), all tied within one bin
        logits = torch.randn(len(rows), vocab, device="cuda", generator=gen) * scale
        logits[0, : vocab // 2] = -float("inf")
        for filtered in (False, True):
            picked = slice(None) if not filtered else slice(0, 5)
            draws = []
            for fused in (True, False):
                monkeypatch.setattr(sampling._FUSED_SAMPLER, "usable", fused)
                monkeypatch.setattr(sampling, "FUSED_MAX_VOCAB", 1 << 30)
                torch.manual_seed(7)
                draws.append(sampling.sample_static(logits[picked], table[picked], seen[picked], filtered).tolist())
            assert draws[0] == draws[1], (vocab, scale, filtered)


@pytest.mark.parametrize("config", [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (512, 4), (32768, 16)])
def test_fused_sampling_slice_configs_draw_the_same(monkeypatch, config):
    """Every (slice, warps) config `benchmarks/sampler_micro.py --kernel-configs` times draws what the
    PyTorch form draws, on peaked and flat Orpheus-width rows (32,768: the whole row in one program)."""
    import mstar.engines.sampling as sampling
    from mstar.kernels.fused_sampling import sample_rows

    vocab = 28_680
    gen = torch.Generator(device="cuda").manual_seed(sum(config))
    params = [SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3), SamplingParams(top_k=40),
              SamplingParams(top_p=0.5, min_p=0.02)]
    rows = [SamplingRow(p, list(range(i, i + 50)), 40) for i, p in enumerate(params)]
    table = filters.RowTable.columns(rows, vocab).cuda()
    seen = filters.seen_masks(rows, vocab, torch.device("cuda"))
    monkeypatch.setattr(sampling._FUSED_SAMPLER, "usable", False)  # sample_static: the PyTorch form
    for scale in (3.0, 0.3):
        logits = torch.randn(len(rows), vocab, device="cuda", generator=gen) * scale
        torch.manual_seed(3)
        noise = torch.empty(logits.shape, device="cuda").exponential_()
        torch.manual_seed(3)
        expected = sampling.sample_static(logits, table, seen, True)
        got = sample_rows(logits, table, seen, noise, True, *config)
        assert got.tolist() == expected.tolist(), (config, scale)
