"""Code2Wav's padded chunks (`pad_frames`: one call shape for every chunk) and its warm-up."""

from __future__ import annotations

import pytest
import torch

from mstar.engines.base import StatelessSpec, StepGraphs
from mstar.models.qwen3_omni.builders import CODE2WAV_BATCH, code2wav_widths
from mstar.models.qwen3_omni.code2wav import Code2Wav
from mstar.models.qwen3_omni.code2wav_config import Code2WavConfig
from mstar.models.qwen3_omni.model import Qwen3Omni

CFG = Code2WavConfig.tiny()
CHUNK, CONTEXT = 6, 5


@pytest.fixture(scope="module")
def module() -> Code2Wav:
    """In float64: padding changes the GEMM and convolution shapes, so float32 sums round differently
    (up to 2e-4 here, through SnakeBeta's sines of large arguments); in float64 only a real dependence
    on the padding could show."""
    torch.manual_seed(0)
    m = Code2Wav(CFG).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)  # large enough that every stage changes the audio
    return m.double()


def _chunk(frames: int, new: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"codes": torch.randint(0, CFG.codebook_size, (frames, CFG.num_quantizers), generator=gen),
            "codes_new": torch.tensor(new)}


def _run(module: Code2Wav, items: list[dict[str, torch.Tensor]], pad: int) -> list[torch.Tensor]:
    module.pad_frames = pad
    try:
        return [out["audio"] for out in module.run_batch("vocode", "code2wav", items, [{}] * len(items))]
    finally:
        module.pad_frames = 0


# (frames, new): a first chunk, a full chunk with context, last chunks with context, a short first chunk
SHAPES = [(CHUNK, CHUNK), (CHUNK + CONTEXT, CHUNK), (CONTEXT + 2, 2), (CONTEXT + 1, 1), (3, 3)]


@pytest.mark.parametrize(("frames", "new"), SHAPES)
def test_padded_chunk_gives_the_unpadded_audio(module, frames: int, new: int) -> None:
    item = _chunk(frames, new, seed=frames * 10 + new)
    plain, = _run(module, [item], pad=0)
    padded, = _run(module, [item], pad=CHUNK + CONTEXT)
    assert plain.shape == padded.shape
    expected = new * CFG.samples_per_frame - (0 if frames > new else module.lookahead_samples)
    assert plain.shape[-1] == expected
    torch.testing.assert_close(padded, plain, rtol=0, atol=1e-6)  # float64 sums, float32 audio


def test_padding_batches_chunks_of_every_length_in_one_forward(module) -> None:
    items = [_chunk(f, n, seed=i) for i, (f, n) in enumerate(SHAPES)]
    alone = [_run(module, [x], pad=0)[0] for x in items]
    calls = []
    real = module.forward
    module.forward = lambda codes: calls.append(tuple(codes.shape)) or real(codes)
    try:
        together = _run(module, items, pad=CHUNK + CONTEXT)
    finally:
        del module.forward
    assert calls == [(len(items), CFG.num_quantizers, CHUNK + CONTEXT)]
    for got, want in zip(together, alone):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # float64 sums, float32 audio


def test_without_padding_each_length_is_its_own_call(module) -> None:
    items = [_chunk(f, n, seed=i) for i, (f, n) in enumerate(SHAPES)]
    calls = []
    real = module.forward
    module.forward = lambda codes: calls.append(codes.shape[-1]) or real(codes)
    try:
        _run(module, items, pad=0)
    finally:
        del module.forward
    assert sorted(calls) == sorted({f for f, _ in SHAPES})


def test_warm_up_decodes_each_width_once(module) -> None:
    calls = []
    real = module.forward
    module.forward = lambda codes: calls.append(tuple(codes.shape)) or real(codes)
    try:
        module.warm_up([CHUNK + CONTEXT, CHUNK, CHUNK])
    finally:
        del module.forward
    assert calls == [(1, CFG.num_quantizers, CHUNK), (1, CFG.num_quantizers, CHUNK + CONTEXT)]


def test_serve_config_picks_the_widths() -> None:
    """Padding is on by default where Code2Wav runs on CUDA (one width: graphs), off on the CPU."""
    assert code2wav_widths(Qwen3Omni.make_config()) == (0, [25, 50])
    assert code2wav_widths(Qwen3Omni.make_config(), "cuda") == (50, [50])
    assert code2wav_widths(Qwen3Omni.make_config(code2wav_pad=False), "cuda") == (0, [25, 50])
    assert code2wav_widths(Qwen3Omni.make_config(code2wav_pad=True, code2wav_chunk=30)) == (55, [55])


def test_graph_sizes_reach_the_max_batch() -> None:
    """Its engine captures powers of two below the batch limit, and the limit; set sizes above it are dropped."""
    assert StatelessSpec(max_batch_size=CODE2WAV_BATCH).graph_sizes() == [1, 2, 4, 8, 16, 32]
    assert StatelessSpec(max_batch_size=12).graph_sizes() == [1, 2, 4, 8, 12]
    assert StatelessSpec(max_batch_size=1).graph_sizes() == [1]
    assert StatelessSpec(max_batch_size=8, cuda_graph_sizes=[4, 1, 16]).graph_sizes() == [1, 4]
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        StatelessSpec(cuda_graph_sizes=[0])


def test_code2wav_build_reads_its_engines_max_batch_size() -> None:
    """The build (whose CUDA graphs reach its batch limit) reads the deployment's
    `engines.code2wav.max_batch_size` through Model.engine_spec; the model's default otherwise."""
    from mstar.config import config_from_dict
    from mstar.runtime.build import build_model

    model = build_model(config_from_dict({"model": "qwen3_omni", "engines": {"code2wav": {"max_batch_size": 12}}}),
                        tiny=True)
    assert model.build_component("code2wav", torch.device("cpu")).engine.max_batch_size == 12
    plain = build_model(config_from_dict({"model": "qwen3_omni"}), tiny=True)
    assert plain.build_component("code2wav", torch.device("cpu")).engine.max_batch_size == CODE2WAV_BATCH


def test_served_flags_and_int32_codes(module) -> None:
    """The served component reads `codes_new` on the host and hands audio out through host copies on CUDA
    (its engine flags); a chunk given as another dtype of ids decodes the same."""
    assert module.host_inputs and module.host_outputs and module.side_stream
    item = _chunk(CHUNK + CONTEXT, CHUNK, seed=3)
    as_int32 = {**item, "codes": item["codes"].int()}
    a, b = _run(module, [item, as_int32], pad=0)
    assert torch.equal(a, b) and a.dtype == torch.float32


class _StubGraphs:
    """BatchGraphs' interface over the eager decode, recording each replay's batch and keeping one output
    buffer, as a captured graph does (the next replay overwrites it)."""

    def __init__(self, module: Code2Wav, max_batch: int) -> None:
        self.module, self.max_batch, self.batches = module, max_batch, []
        self.buffer: torch.Tensor | None = None

    def __call__(self, codes: torch.Tensor) -> tuple[torch.Tensor]:
        self.batches.append(codes.shape[0])
        out = self.module.decode(codes)
        if self.buffer is None or self.buffer.shape != out.shape:
            self.buffer = torch.empty_like(out)
        return (self.buffer.copy_(out),)


def test_padded_calls_replay_the_graphs_up_to_their_batch(module) -> None:
    items = [_chunk(f, n, seed=i) for i, (f, n) in enumerate(SHAPES)]
    alone = [_run(module, [x], pad=0)[0] for x in items]
    module.pad_frames = CHUNK + CONTEXT
    (plan,) = module.capture_plans()
    graphs = _StubGraphs(module, max_batch=4)
    module.graphs = StepGraphs({plan.key: graphs})
    try:
        first = _run(module, items[:4], pad=CHUNK + CONTEXT)
        _run(module, items[1:], pad=CHUNK + CONTEXT)  # would overwrite `first` if it were a view
        _run(module, items, pad=CHUNK + CONTEXT)  # 5 chunks: more than the largest graph, eager
        _run(module, items[:2], pad=0)  # unpadded widths: eager
    finally:
        del module.graphs
    assert graphs.batches == [4, 4]
    for got, want in zip(first, alone):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_graphs_need_one_width() -> None:
    """Unpadded chunks vary in width: nothing to capture; padded, the decode of that one width."""
    module = Code2Wav(CFG)
    assert module.capture_plans() == []
    module.pad_frames = 7
    (plan,) = module.capture_plans()
    assert plan.example == (((CFG.num_quantizers, 7), torch.long),)
