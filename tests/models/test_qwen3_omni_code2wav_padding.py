"""Code2Wav's padded chunks (`pad_frames`: one call shape for every chunk) and its warm-up."""

from __future__ import annotations

import pytest
import torch

from mstar.models.qwen3_omni.builders import code2wav_widths
from mstar.models.qwen3_omni.code2wav import Code2Wav
from mstar.models.qwen3_omni.code2wav_config import Code2WavConfig
from mstar.models.qwen3_omni.model import Qwen3Omni

CFG = Code2WavConfig.tiny()
CHUNK, CONTEXT = 6, 5


@pytest.fixture(scope="module")
def module() -> Code2Wav:
    torch.manual_seed(0)
    m = Code2Wav(CFG).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)  # large enough that every stage changes the audio
    return m


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
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)


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
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # batched GEMMs sum in another order


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
    assert code2wav_widths(Qwen3Omni.make_config()) == (0, [25, 50])
    assert code2wav_widths(Qwen3Omni.make_config(code2wav_pad=True, code2wav_chunk=30)) == (55, [55])
