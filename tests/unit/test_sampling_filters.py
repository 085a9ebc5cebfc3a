"""The sort-free filters of sampling_filters.py draw exactly what the sort-based reference draws."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import mstar.engines.sampling_filters as filters
from mstar.engines.sampling import SamplingParams, SamplingRow
from tests.interpreted import run_interpreted


def _reference(x: torch.Tensor, params: list[SamplingParams], noise: torch.Tensor) -> list[int]:
    """The pre-prefilter algorithm: top-k mask, softmax, top-p by a full sort, min-p, race."""
    out = []
    for i, p in enumerate(params):
        row = x[i].clone()
        if p.top_k:
            row[row < row.topk(p.top_k).values[-1]] = -math.inf
        probs = row.softmax(-1)
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p if p.top_p < 1 else torch.zeros_like(sorted_p, dtype=bool)
        probs[order[drop]] = 0.0
        probs[probs < p.min_p * probs.max()] = 0.0
        out.append(int((probs / noise[i]).argmax()))
    return out


PARAMS = [SamplingParams(top_p=0.8), SamplingParams(top_p=0.3, min_p=0.05), SamplingParams(top_k=7),
          SamplingParams(top_k=40, top_p=0.9), SamplingParams(), SamplingParams(min_p=0.1),
          SamplingParams(top_p=0.99)]


@pytest.mark.parametrize("prefilter", [4, 64, 1024])
def test_pick_equals_the_sorted_reference(monkeypatch, prefilter):
    """Small prefilters force the whole-vocabulary fallback on most rows; the draws never change."""
    monkeypatch.setattr(filters, "PREFILTER_K", prefilter)
    gen = torch.Generator().manual_seed(prefilter)
    rows = [SamplingRow(p, [], 0) for p in PARAMS]
    for trial in range(15):
        x = torch.randn(len(rows), 300, generator=gen) * (0.5 + trial % 4)
        noise = torch.empty_like(x).exponential_(generator=gen)
        table = filters.RowTable(rows, x.shape[1], x.device)
        assert filters.pick(x, rows, table, noise).tolist() == _reference(x, PARAMS, noise), trial


def test_prefilter_covers_peaked_rows_and_flags_flat_ones(monkeypatch):
    monkeypatch.setattr(filters, "PREFILTER_K", 8)
    x = torch.zeros(2, 100)
    x[0, :3] = 20.0  # all the mass in 3 tokens: the 8 best hold the nucleus
    rows = [SamplingRow(SamplingParams(top_p=0.8), [], 0)] * 2
    table = filters.RowTable(rows, 100, x.device)
    _, covered, _, _ = filters._race_prefiltered(x, table, torch.ones_like(x))
    assert covered.tolist() == [True, False]


def test_seen_masks_follow_the_batch_and_its_changes():
    params = SamplingParams(repetition_penalty=1.3)
    a, b = SamplingRow(params, [1, 2], 1, cache={}), SamplingRow(params, [3], 1, cache={})
    first = filters.seen_masks([a, b], 10, torch.device("cpu"))
    a.token_ids.append(5)
    again = filters.seen_masks([a, b], 10, torch.device("cpu"))
    assert again is first  # same rows, same order: updated in place
    assert again[0].nonzero()[:, 0].tolist() == [1, 2, 5] and again[1].nonzero()[:, 0].tolist() == [3]
    swapped = filters.seen_masks([b, a], 10, torch.device("cpu"))
    assert swapped is not first
    assert swapped[0].nonzero()[:, 0].tolist() == [3] and swapped[1].nonzero()[:, 0].tolist() == [1, 2, 5]
    restarted = SamplingRow(params, [7], 1, cache=a.cache)  # the sequence began anew
    assert filters.seen_masks([b, restarted], 10, torch.device("cpu"))[1].nonzero()[:, 0].tolist() == [7]


def test_triton_nucleus_race_equals_the_reference_interpreted():
    pytest.importorskip("triton")
    proc = run_interpreted(Path(__file__).with_name("nucleus_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nucleus ok" in proc.stdout


def test_fused_prefilter_race_equals_the_torch_form_interpreted():
    pytest.importorskip("triton")
    proc = run_interpreted(Path(__file__).with_name("prefilter_race_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "prefilter ok" in proc.stdout


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_fused_sampling_equals_the_torch_form_interpreted():
    pytest.importorskip("triton")
    proc = run_interpreted(Path(__file__).with_name("fused_sampling_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fused sampling ok" in proc.stdout


def test_fused_sampling_equals_the_torch_form_interpreted_one_batch_each():
    """The default run's representative of the check above (its whole run is in the slow group)."""
    pytest.importorskip("triton")
    proc = run_interpreted(Path(__file__).with_name("fused_sampling_check.py"), "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fused sampling ok" in proc.stdout


def test_fused_race_that_fails_hands_over_to_the_torch_form(monkeypatch, caplog):
    """A Triton that cannot build the fused race kernel costs one logged failure, not a failed step:
    the PyTorch form serves from then on."""
    pytest.importorskip("triton")
    import mstar.kernels.nucleus as nucleus

    def broken(*args, **kwargs):
        raise RuntimeError("no such intrinsic")

    monkeypatch.setattr(nucleus, "prefilter_race_", broken)
    race = filters.KernelGuard("fused prefilter race")
    rows = [SamplingRow(SamplingParams(top_p=0.8), [1], 1)]
    table = filters.RowTable(rows, 50, torch.device("cpu"))
    vals, idx = torch.randn(1, 50).topk(8)
    assert race.run(lambda: filters._prefilter_race(vals, idx, torch.ones(1), table, torch.ones(1, 50)),
                    lambda: None) is None
    assert race.run(lambda: 1 / 0, lambda: None) is None, "a failed kernel is not tried again"
    assert race.usable is False and "fused prefilter race kernel failed" in caplog.text
