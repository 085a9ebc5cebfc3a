"""Code predictor under a CUDA graph and Code2Wav on the GPU (full size, dummy weights, bf16)."""

from __future__ import annotations

import pytest
import torch

from mstar.models.qwen3_omni.code2wav_config import Code2WavConfig
from mstar.models.qwen3_omni.code_predictor_config import CodePredictorConfig
from mstar.models.qwen3_omni.code_predictor_sampling import CodePredictorSampling, build_sampling_tensors
from mstar.models.qwen3_omni.codec_weights import build_code2wav, build_code_predictor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BATCH = 8


def _capture(fn):
    """Warm up on a side stream, then capture `fn()` in a CUDA graph; returns (graph, its outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@torch.no_grad()
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_code_predictor_cuda_graph_replay_equals_eager(temperature):
    cfg = CodePredictorConfig.full()
    model = build_code_predictor(cfg, None, load_format="dummy", dtype=torch.bfloat16, device="cuda")
    params = [CodePredictorSampling(temperature=temperature, seed=i) for i in range(BATCH)]
    sampling = build_sampling_tensors(params, list(range(BATCH)), cfg.num_residual, cfg.vocab_size,
                                      torch.device("cuda"))
    hidden = torch.zeros(BATCH, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
    first = torch.zeros(BATCH, dtype=torch.long, device="cuda")
    graph, (codes, embed_sum) = _capture(lambda: model.predict(hidden, first, sampling))
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        hidden.copy_(torch.randn(hidden.shape, generator=gen, device="cuda"))
        first.copy_(torch.randint(0, 2048, first.shape, generator=gen, device="cuda"))
        if sampling.noise is not None:
            sampling.noise.exponential_(generator=gen)
        graph.replay()
        eager_codes, eager_sum = model.predict(hidden.clone(), first.clone(), sampling)
        assert torch.equal(codes, eager_codes)
        torch.testing.assert_close(embed_sum, eager_sum)
        assert int(codes[:, 1:].max()) < cfg.vocab_size and int(codes.min()) >= 0


@torch.no_grad()
def test_code2wav_full_size_chunk_on_gpu():
    cfg = Code2WavConfig.full()
    model = build_code2wav(cfg, None, load_format="dummy", dtype=torch.bfloat16, device="cuda")
    codes = torch.randint(0, cfg.codebook_size, (4, 25 + 50, cfg.num_quantizers), device="cuda")
    inputs = [{"codes": c, "codes_new": torch.tensor(50)} for c in codes]
    out = model.run_batch("talker", "code2wav", inputs, [{}] * 4)
    assert [o["audio"].shape[0] for o in out] == [50 * 1920] * 4
    assert all(o["audio"].dtype == torch.float32 and bool(o["audio"].isfinite().all()) for o in out)


@torch.no_grad()
def test_tiny_code2wav_gpu_matches_cpu():
    cfg = Code2WavConfig.tiny()
    cpu = build_code2wav(cfg, None, load_format="dummy")
    for p in cpu.parameters():  # dummy weights leave layer scales at 0; make every stage count
        p.add_(torch.randn_like(p) * 0.05)
    gpu = build_code2wav(cfg, None, load_format="dummy", device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    codes = torch.randint(0, cfg.codebook_size, (2, cfg.num_quantizers, 30))
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # TF32 convolutions would round to about 1e-3
    try:
        torch.testing.assert_close(gpu(codes.cuda()).cpu(), cpu(codes), atol=1e-4, rtol=0)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def test_served_code_predictor_replays_its_graphs():
    """run_batch with captured graphs (the server captures them on CUDA in bf16) equals eager."""
    model = build_code_predictor(CodePredictorConfig.full(), None, load_format="dummy", dtype=torch.bfloat16,
                                 device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(BATCH, model.cfg.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
    first = torch.randint(0, 2048, (BATCH,), device="cuda", generator=gen)
    opts = [{"code_predictor.temperature": 0.9, "code_predictor.seed": 5}] * BATCH
    inputs = [{"talker_hidden": hidden[i], "first_code": first[i:i + 1], "frame_index": torch.tensor(i)}
              for i in range(BATCH)]
    want = model.run_batch("talker", "code_predictor", inputs, opts)
    from mstar.engines.stateless import capture_step_graphs

    capture_step_graphs(model, [1, 2, 4, BATCH], torch.device("cuda"))
    assert set(model.graphs.keys()) == {False, True}
    got = model.run_batch("talker", "code_predictor", inputs, opts)
    again = model.run_batch("talker", "code_predictor", inputs, opts)  # a later replay leaves `got` intact
    for g, a, w in zip(got, again, want):
        assert torch.equal(g["codes"], w["codes"]) and torch.equal(a["codes"], w["codes"])
        torch.testing.assert_close(g["codec_embed_sum"], w["codec_embed_sum"])
