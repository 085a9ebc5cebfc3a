"""Orpheus on a GPU: the SNAC window decode under a CUDA graph, and the full-size dummy model end to end."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


def test_snac_window_decode_replays_under_a_cuda_graph(cuda):
    """decode_windows has static shapes and no host sync: capture [B, 28] once, replay == eager."""
    from mstar.models.orpheus.snac import SnacConfig
    from mstar.models.orpheus.tokens import FRAME, OrpheusTokens
    from mstar.models.orpheus.vocoder import OrpheusVocoder
    from mstar.models.orpheus.weights import load_snac

    vocoder = OrpheusVocoder(load_snac(SnacConfig(), None, cuda), OrpheusTokens()).to(cuda)
    tokens = vocoder.tokens
    batch = 16
    gen = torch.Generator(device=cuda).manual_seed(0)
    codes = torch.randint(1, 4096, (batch, 4, FRAME), device=cuda, generator=gen)
    static_tokens = (codes + tokens.audio_offset + torch.arange(FRAME, device=cuda) * 4096).reshape(batch, -1)
    static_first = torch.arange(batch, device=cuda)
    eager = vocoder.decode_windows(static_tokens, static_first).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        vocoder.decode_windows(static_tokens, static_first)  # warm up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = vocoder.decode_windows(static_tokens, static_first)
    graph.replay()
    torch.cuda.synchronize()
    assert static_out.shape == (batch, 4 * 2048)
    assert (static_out - eager).abs().max().item() < 1e-4


def test_graph_plans_give_the_samples_of_eager_whole_window_decodes(cuda):
    """run_batch with the captured plans (the kept frames' own graphs, and a plan without one sliced from
    its whole window's graph) emits the samples of eager whole-window decodes, batched two windows a plan
    (TF32 off: with it the convolutions of different lengths round differently, ~3e-4 apart)."""
    from mstar.models.orpheus.snac import SnacConfig
    from mstar.models.orpheus.tokens import OrpheusTokens
    from mstar.models.orpheus.vocoder import OrpheusVocoder
    from mstar.models.orpheus.weights import load_snac

    vocoder = OrpheusVocoder(load_snac(SnacConfig(), None, cuda), OrpheusTokens()).to(cuda)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        _check_graph_plans(vocoder, cuda)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def _check_graph_plans(vocoder, cuda):
    from mstar.engines.stateless import capture_step_graphs
    from mstar.models.orpheus.tokens import FRAME
    from mstar.models.orpheus.vocoder import plan_window

    capture_step_graphs(vocoder, [1, 2], vocoder.noise_table.device)
    tokens = vocoder.tokens
    gen = torch.Generator().manual_seed(4)
    stream = (torch.randint(1, 4096, (30, FRAME), generator=gen) + tokens.audio_offset
              + torch.arange(FRAME) * 4096).reshape(-1)  # 30 frames of one request's stream

    def item(start, length, new, final):
        return {"codes": stream[start: start + length], "codes_new": torch.tensor(new),
                "codes_start": torch.tensor(start), "codes_final": torch.tensor(final)}
    # ordinary windows (4, 1, 2), final windows after a mid-frame stop (3, 1, 3) and at a frame's end
    # (4, 2, 4), and the first full window without an early one (4, 0, 2): no graph of its own, sliced
    # from the whole window's
    items = [item(7, 28, 7, False), item(63, 28, 7, False), item(100, 28, 5, True), item(121, 28, 5, True),
             item(70, 28, 7, True), item(140, 28, 7, True), item(0, 28, 28, False)]
    plans = [plan_window(28, int(x["codes_new"]), int(x["codes_start"]), bool(x["codes_final"])) for x in items]
    assert [(p.frames, p.emit_from, p.emit_to) for p in plans] == [(4, 1, 2)] * 2 + [(3, 1, 3)] * 2 + [(4, 2, 4)] * 2 \
        + [(4, 0, 2)]
    got = vocoder.run_batch("vocode", "snac", items, [{}] * len(items))
    torch.cuda.synchronize()
    for x, plan, out in zip(items, plans, got):
        span = x["codes"][plan.first_token: plan.first_token + FRAME * plan.frames]
        whole = vocoder.decode_windows(span[None].to(cuda), torch.tensor([plan.first_frame], device=cuda))[0]
        lo, hi = plan.emit_from * 2048, plan.emit_to * 2048
        assert out["audio"].shape == (hi - lo,)
        assert (out["audio"].cpu() - whole[lo:hi].cpu()).abs().max().item() < 1e-4, plan


def test_full_size_dummy_speaks_frames(cuda):
    """The 3B dummy LM (bf16) emits well-formed frames, so the vocoder decodes every one of them."""
    from mstar.runtime.offline import MStar

    config = {"model": "orpheus", "node_groups": [{"node_names": ["llm", "snac"], "ranks": [0]}],
              "kv_cache": {"page_size": 16}}
    with MStar("orpheus", config=config, load_format="dummy") as m:
        result = m.generate({"text": "Hello from the GPU."}, max_tokens=140, seed=0)
    audio = np.concatenate(result.outputs["audio"])
    assert audio.dtype == np.float32 and audio.size == 140 // 7 * 2048


def test_vocoder_steps_run_on_their_own_stream(cuda):
    """The vocoder (side_stream) gets a CUDA stream of its own in the stateless engine, and what it
    hands out from there equals what it computes on the default stream."""
    from mstar.engines.base import StepItem
    from mstar.engines.stateless import StatelessEngine
    from mstar.models.orpheus.snac import SnacConfig
    from mstar.models.orpheus.tokens import FRAME, OrpheusTokens
    from mstar.models.orpheus.vocoder import OrpheusVocoder
    from mstar.models.orpheus.weights import load_snac

    vocoder = OrpheusVocoder(load_snac(SnacConfig(), None, cuda), OrpheusTokens()).to(cuda)
    tokens = vocoder.tokens
    gen = torch.Generator().manual_seed(1)

    def window(start: int) -> dict:
        codes = torch.randint(1, 4096, (4, FRAME), generator=gen)
        flat = (codes + tokens.audio_offset + torch.arange(FRAME) * 4096).reshape(-1)
        new = FRAME if start else FRAME * 4  # the first window: all new (no early window before it)
        return {"codes": flat, "codes_new": torch.tensor(new), "codes_start": torch.tensor(start),
                "codes_final": torch.tensor(False)}

    windows = [window(7 * i) for i in range(6)]

    def run(engine: StatelessEngine) -> list[torch.Tensor]:
        for i, w in enumerate(windows):
            engine.submit(StepItem(f"r{i}", "speak", "vocode", w))
        out = {}
        while engine.has_work():
            for r in engine.step():
                assert r.error is None, r.error
                out[r.request_id] = r.outputs["audio"]
        return [out[f"r{i}"] for i in range(len(windows))]

    side = StatelessEngine(vocoder)
    assert side.stream is not None and side.stream != torch.cuda.current_stream()
    got = run(side)
    default = StatelessEngine(vocoder)
    default.stream = None
    expected = run(default)
    assert all(g.device.type == "cpu" for g in got)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_snac_snake_kernel_equals_the_torch_form(cuda):
    """SNAC's Snake through the fused Triton kernel (kernels/snake.py) at a decoder width, in float32."""
    from mstar.layers.fused import fused_kernels
    from mstar.models.orpheus.snac import Snake

    module = Snake(96).to(cuda)
    with torch.no_grad():
        module.alpha.uniform_(0.2, 3.0)
    x = torch.randn(8, 96, 4096, device=cuda) * 3
    fused = module(x)
    with fused_kernels(False):
        reference = module(x)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


def test_fused_snac_kernels_equal_the_torch_form_on_cuda(cuda):
    """Full-size SNAC (random weights): the fused kernels' window decode equals PyTorch's form (float32,
    TF32 off so both run the same convolution math), and under a CUDA graph too."""
    from mstar.engines.cuda_graphs import BatchGraphs
    from mstar.layers.fused import fused_kernels
    from mstar.models.orpheus.snac import SnacConfig
    from mstar.models.orpheus.tokens import FRAME, OrpheusTokens
    from mstar.models.orpheus.vocoder import OrpheusVocoder
    from mstar.models.orpheus.weights import load_snac

    vocoder = OrpheusVocoder(load_snac(SnacConfig(), None, cuda), OrpheusTokens()).to(cuda)
    gen = torch.Generator(device=cuda).manual_seed(2)
    codes = torch.randint(0, 4096, (4, 4, FRAME), device=cuda, generator=gen)
    ids = (codes + vocoder.tokens.audio_offset + torch.arange(FRAME, device=cuda) * 4096).reshape(4, -1)
    first = torch.tensor([0, 9, 77, 250000], device=cuda)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        fused = vocoder.decode_windows(ids, first)
        with fused_kernels(False):
            reference = vocoder.decode_windows(ids, first)
        graphs = BatchGraphs(vocoder.decode_windows, (4,), [((4 * FRAME,), torch.long), ((), torch.long)], cuda)
        (replayed,) = graphs(ids, first)
        # an ordinary window's kept frame alone (each block on its span), eagerly and from a graph
        kept = vocoder.decode_windows(ids, first, (1, 2))
        with fused_kernels(False):
            kept_reference = vocoder.decode_windows(ids, first, (1, 2))
        kept_graphs = BatchGraphs(functools.partial(vocoder.decode_windows, emit=(1, 2)), (4,),
                                  [((4 * FRAME,), torch.long), ((), torch.long)], cuda)
        (kept_replayed,) = kept_graphs(ids, first)
        torch.cuda.synchronize()
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    assert fused.shape == reference.shape == (4, 4 * 2048)
    assert (fused - reference).abs().max().item() < 1e-4
    assert torch.equal(replayed, fused)
    assert kept.shape == (4, 2048)
    assert (kept - fused[:, 2048:4096]).abs().max().item() < 1e-4
    assert (kept - kept_reference).abs().max().item() < 1e-4
    assert torch.equal(kept_replayed, kept)
