"""The frame-place head kernel (`mstar/kernels/window_head.py`) on the GPU at Orpheus-3B's shape: equal to
the masked whole-head reference, under a CUDA graph, with PDL as the decode step launches it."""

from __future__ import annotations

import pytest
import torch

from mstar.kernels import window_head
from mstar.layers.logit_windows import masked_window_logits
from mstar.models.orpheus.tokens import FRAME, OrpheusTokens

DEVICE = "cuda"


@pytest.mark.parametrize("rows", [1, 2, 4, 6])
def test_window_head_equals_the_masked_head_at_orpheus_shape(rows):
    tokens = OrpheusTokens()
    lo, hi = tokens.speakable_span
    windows = tokens.place_windows(tokens.vocab_size).to(DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    weight = (0.02 * torch.randn(hi - lo, 3072, device=DEVICE, generator=gen)).bfloat16()
    hidden = torch.randn(rows, 3072, device=DEVICE, generator=gen).bfloat16()
    # inputs of every kind: start of speech and audio tokens of several places
    ids = torch.tensor([tokens.start_of_speech] + [tokens.audio_offset + (p % FRAME) * tokens.codebook_size + 17 * p
                                                   for p in range(rows - 1)], device=DEVICE)
    torch.cuda.synchronize()
    want = masked_window_logits(torch.nn.functional.linear(hidden.float(), weight.float()), ids, windows)
    eager = window_head.window_logits(hidden, weight, ids, windows)
    buffer = torch.full((8, hi - lo), 7.0, device=DEVICE)  # rows of a sampler's logits buffer, as the decode graphs pass
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = window_head.window_logits(hidden, weight, ids, windows)
        into = window_head.window_logits(hidden, weight, ids, windows, out=buffer[:rows])
    graph.replay()
    torch.cuda.synchronize()
    finite = ~torch.isinf(want)
    assert finite.sum().item() == rows * tokens.codebook_size  # 4,095 codes and end of speech a row
    for got in (eager, static):
        assert torch.equal(torch.isinf(got), ~finite)
        torch.testing.assert_close(got[finite], want[finite], atol=2e-3, rtol=2e-3)
    assert torch.equal(eager, static) and torch.equal(into, static) and into.data_ptr() == buffer.data_ptr()
    assert bool((buffer[rows:] == 7.0).all())
