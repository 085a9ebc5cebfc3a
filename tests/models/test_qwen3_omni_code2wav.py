"""Code2Wav parity with transformers (tiny, float32) and chunked decoding against one-shot decoding."""

from __future__ import annotations

import pytest
import torch

from mstar.graph.chunking import LeftContext
from mstar.models.qwen3_omni.code2wav_config import Code2WavConfig
from mstar.models.qwen3_omni.codec_weights import build_code2wav
from mstar.worker.streams import END, StreamBuffer
from tests.models.qwen3_omni_codec_testing import hf_code2wav_config, make_hf_code2wav, save_checkpoint

CFG = Code2WavConfig.tiny()
FRAMES = 50


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers Code2Wav, ours loaded from the same weights saved under `code2wav.`)."""
    ref = make_hf_code2wav(CFG)
    path = save_checkpoint({f"code2wav.{k}": v for k, v in ref.state_dict().items()},
                           tmp_path_factory.mktemp("code2wav"))
    return ref, build_code2wav(CFG, path, progress=False)


@pytest.fixture(scope="module")
def codes():
    return torch.randint(0, CFG.codebook_size, (2, CFG.num_quantizers, FRAMES), generator=torch.Generator().manual_seed(3))


def test_config_from_hf_dict():
    assert Code2WavConfig.from_hf(hf_code2wav_config(CFG)) == CFG
    full = Code2WavConfig.full()
    assert full.samples_per_frame == 1920 and full.head_dim == 64


@torch.no_grad()
def test_one_shot_audio_matches_reference(pair, codes):
    ref, ours = pair
    expected = ref(codes)[:, 0]
    audio = ours(codes)
    assert audio.shape == expected.shape == (2, FRAMES * CFG.samples_per_frame - ours.lookahead_samples)
    # The test weights keep most samples inside the clamp, so the comparison is not of saturated +-1s.
    assert (expected.abs() < 0.999).float().mean() > 0.9 and expected.std() > 0.05
    torch.testing.assert_close(audio, expected, atol=1e-4, rtol=0)
    # Through the component interface ([frames, Q] per request, no codes_new: one shot).
    out = ours.run_batch("talker", "code2wav", [{"codes": c.T} for c in codes], [{}, {}])
    for row, item in zip(expected, out):
        torch.testing.assert_close(item["audio"], row, atol=1e-4, rtol=0)


@torch.no_grad()
def test_reference_trim_matches_reference_chunked_decode(pair, codes):
    ref, ours = pair
    expected = ref.chunked_decode(codes, chunk_size=8, left_context_size=3)[:, 0]
    audio = ours.chunked_decode(codes, chunk=8, left_context=3, trim="reference")
    torch.testing.assert_close(audio, expected, atol=1e-4, rtol=0)
    # The reference drops `lookahead_samples` before each of its 6 chunk boundaries.
    assert expected.shape[-1] == ref(codes).shape[-1] - 6 * ours.lookahead_samples


@torch.no_grad()
def test_seamless_chunks_with_exact_context_equal_one_shot(pair, codes):
    _, ours = pair
    one_shot = ours(codes)
    context = ours.exact_context_frames
    assert context < FRAMES - 8  # some chunks really carry the full context
    audio = ours.chunked_decode(codes, chunk=8, left_context=context)
    assert audio.shape == one_shot.shape
    torch.testing.assert_close(audio, one_shot, atol=1e-4, rtol=0)


@torch.no_grad()
def test_seamless_chunks_with_short_context_have_one_shot_length_only(pair, codes):
    _, ours = pair
    one_shot = ours(codes)
    audio = ours.chunked_decode(codes, chunk=8, left_context=3)
    assert audio.shape == one_shot.shape
    first = 8 * CFG.samples_per_frame - ours.lookahead_samples  # the first chunk has no context to lack
    torch.testing.assert_close(audio[:, :first], one_shot[:, :first], atol=1e-4, rtol=0)
    # Beyond it a 3-frame context cuts the receptive field: an approximation, not equality.
    assert (audio - one_shot).abs().max() > 1e-3


@torch.no_grad()
def test_stream_chunks_through_run_batch_equal_one_shot(pair, codes):
    """Frames cut by the worker's StreamBuffer under LeftContext; two requests' chunks batch together."""
    _, ours = pair
    buffers = [StreamBuffer(LeftContext(chunk=6, context=ours.exact_context_frames)) for _ in range(2)]
    for buffer, request_codes in zip(buffers, codes):
        for seq, frame in enumerate(request_codes.T):
            buffer.put(seq, frame[None])  # the talker emits one [1, Q] item per frame
        buffer.end(FRAMES)
    pieces: list[list[torch.Tensor]] = [[], []]
    while (chunks := [b.pop() for b in buffers])[0] is not END:
        inputs = [{"codes": c.value, "codes_new": torch.tensor(c.new)} for c in chunks]
        for piece, item in zip(pieces, ours.run_batch("talker", "code2wav", inputs, [{}, {}])):
            piece.append(item["audio"])
    assert len(pieces[0]) == -(-FRAMES // 6)
    for piece, one_shot in zip(pieces, ours(codes)):
        torch.testing.assert_close(torch.cat(piece), one_shot, atol=1e-4, rtol=0)


@torch.no_grad()
def test_mixed_chunk_shapes_in_one_batch(pair, codes):
    _, ours = pair
    inputs = [
        {"codes": codes[0].T[:12], "codes_new": torch.tensor(4)},
        {"codes": codes[1].T[:12], "codes_new": torch.tensor(4)},
        {"codes": codes[1].T[:7], "codes_new": torch.tensor(7)},
    ]
    out = ours.run_batch("talker", "code2wav", inputs, [{}] * 3)
    for x, item in zip(inputs, out):
        alone = ours.decode_chunk(x["codes"].T[None], int(x["codes_new"]))[0]
        torch.testing.assert_close(item["audio"], alone, atol=1e-5, rtol=0)
    assert out[2]["audio"].shape[-1] == 7 * CFG.samples_per_frame - ours.lookahead_samples
    assert out[0]["audio"].shape[-1] == 4 * CFG.samples_per_frame


def test_bad_codes_are_rejected(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="codes \\[frames, 16\\]"):
        ours.run_batch("talker", "code2wav", [{"codes": torch.zeros(16, 3, dtype=torch.long)}], [{}])
    with pytest.raises(ValueError, match="codes_new=5"):
        ours.run_batch("talker", "code2wav", [{"codes": torch.zeros(3, 16, dtype=torch.long),
                                               "codes_new": torch.tensor(5)}], [{}])
