"""Sampling on CUDA: no host sync in the Orpheus serving case, and the Triton nucleus race equals the
sort-based reference at the full Orpheus vocabulary."""

from __future__ import annotations

import torch

import mstar.engines.sampling_filters as filters
from mstar.engines.sampling import SamplingParams, SamplingRow, sample
from mstar.engines.sampling_graph import SamplerGraphs
from mstar.kernels.nucleus import nucleus_race_

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
