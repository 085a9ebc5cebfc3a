"""Qwen3-Omni encoders equal transformers' Qwen3OmniMoeAudioEncoder / Qwen3OmniMoeVisionEncoder (tiny
random configs, float32), with the reference weights loaded through our checkpoint-name mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.models.qwen3_omni.audio_encoder import audio_output_lengths
from mstar.models.qwen3_omni.encoder_config import (
    TINY_AUDIO,
    TINY_VISION,
    AudioEncoderConfig,
    VisionEncoderConfig,
    full_audio_config,
    full_vision_config,
)
from mstar.models.qwen3_omni.encoder_weights import (
    AUDIO_PREFIX,
    VISION_PREFIX,
    build_audio_encoder,
    build_vision_encoder,
    load_encoder,
)
from mstar.models.qwen3_omni.features import (
    VisionPreprocessSpec,
    log_mel_features,
    preprocess_images,
    preprocess_videos,
)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    # noise of std 0.1 on every parameter (norm scales around 1, biases too) so each one visibly matters
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            is_scale = name.endswith("weight") and p.ndim == 1
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if is_scale else 0.0))


@pytest.fixture(scope="module")
def audio_pair():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    reference = Qwen3OmniMoeAudioEncoder(Qwen3OmniMoeAudioEncoderConfig(**TINY_AUDIO)).eval()
    _randomise(reference, 0)
    ours = build_audio_encoder(AudioEncoderConfig.from_hf(TINY_AUDIO), torch.float32)
    load_encoder(ours, None, tensors=[(AUDIO_PREFIX + k, v) for k, v in reference.state_dict().items()])
    return reference, ours


@pytest.fixture(scope="module")
def vision_pair():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeVisionEncoderConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    reference = Qwen3OmniMoeVisionEncoder(Qwen3OmniMoeVisionEncoderConfig(**TINY_VISION)).eval()
    _randomise(reference, 1)
    ours = build_vision_encoder(VisionEncoderConfig.from_hf(TINY_VISION), torch.float32)
    load_encoder(ours, None, tensors=[(VISION_PREFIX + k, v) for k, v in reference.state_dict().items()])
    return reference, ours


def _audios():
    rng = np.random.default_rng(0)
    # 3.3 s crosses the 2 s attention window and ends in a partial 1 s chunk; 0.6 s is under one chunk
    return [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in (52800, 9600)]


def test_audio_encoder_equals_reference_on_a_batch_of_two(audio_pair):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    reference, ours = audio_pair
    feats = log_mel_features(_audios())
    with torch.no_grad():
        expected = reference(feats.features, feats.lengths).last_hidden_state
        got = ours(feats.features, feats.lengths)
    lengths = audio_output_lengths(feats.lengths.tolist(), ours.config)
    assert lengths == _get_feat_extract_output_lengths(feats.lengths).tolist() == [43, 8]
    assert got.shape == expected.shape == (51, TINY_AUDIO["output_dim"])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_audio_encoder_batch_equals_each_audio_alone(audio_pair):
    reference, ours = audio_pair
    audios = _audios()
    with torch.no_grad():
        alone = [ours(f.features, f.lengths) for f in (log_mel_features([a]) for a in audios)]
        # features of each audio computed alone, encoded together: batching must not mix audios
        feats = [log_mel_features([a]) for a in audios]
        features, lengths = torch.cat([f.features for f in feats], 1), torch.cat([f.lengths for f in feats])
        together = ours(features, lengths, group_sizes=[1, 1])
        as_one_request = ours(features, lengths)
        short_reference = reference(feats[1].features, feats[1].lengths).last_hidden_state
    torch.testing.assert_close(together[-8:], short_reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-5, rtol=1e-5)
    # As one request, the short audio's chunk is padded to 1 s like in the reference: its last tokens move.
    assert not torch.allclose(as_one_request[-8:], alone[1], atol=1e-3)
    torch.testing.assert_close(as_one_request[:-8], alone[0], atol=1e-5, rtol=1e-5)


def _vision_batch():
    rng = np.random.default_rng(3)
    image = preprocess_images([rng.integers(0, 256, (70, 100, 3), dtype=np.uint8)])
    spec = VisionPreprocessSpec(video_min_pixels=64 * 64, video_max_pixels=128 * 128)
    video = preprocess_videos([rng.integers(0, 256, (2, 64, 128, 3), dtype=np.uint8)], spec=spec)
    return torch.cat([image.pixel_values, video.pixel_values]), torch.cat([image.grid_thw, video.grid_thw])


def test_vision_encoder_equals_reference_for_image_and_video(vision_pair):
    reference, ours = vision_pair
    pixels, grid_thw = _vision_batch()
    assert grid_thw.tolist() == [[1, 4, 6], [1, 4, 8]]
    with torch.no_grad():
        expected = reference(pixels, grid_thw)
        got = ours(pixels, grid_thw)
    assert got.embeds.shape == expected.pooler_output.shape == (14, TINY_VISION["out_hidden_size"])
    torch.testing.assert_close(got.embeds, expected.pooler_output, atol=1e-5, rtol=1e-5)
    assert len(got.deepstack) == len(expected.deepstack_features) == 2
    for ours_tap, ref_tap in zip(got.deepstack, expected.deepstack_features):
        torch.testing.assert_close(ours_tap, ref_tap, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # inputs of a batch never see each other: the image alone gives the same rows
        alone = ours(pixels[:24], grid_thw[:1])
    torch.testing.assert_close(alone.embeds, got.embeds[:6], atol=1e-5, rtol=1e-5)


def test_vision_encoder_multi_frame_video_equals_reference(vision_pair):
    """A 4-frame video: two temporal slices that must not attend to each other."""
    reference, ours = vision_pair
    spec = VisionPreprocessSpec(video_min_pixels=64 * 64, video_max_pixels=64 * 96)
    frames = np.random.default_rng(4).integers(0, 256, (4, 64, 96, 3), dtype=np.uint8)
    video = preprocess_videos([frames], spec=spec)
    with torch.no_grad():
        expected = reference(video.pixel_values, video.grid_thw)
        got = ours(video.pixel_values, video.grid_thw)
    assert video.grid_thw.tolist() == [[2, 4, 6]]
    torch.testing.assert_close(got.embeds, expected.pooler_output, atol=1e-5, rtol=1e-5)


def test_vision_encoder_rejects_mismatched_inputs(vision_pair):
    _, ours = vision_pair
    pixels, grid_thw = _vision_batch()
    with pytest.raises(ValueError, match="needs"):
        ours(pixels[:-1], grid_thw)
    with pytest.raises(ValueError, match="multiples of 2"):
        ours(pixels[: 15 * 4], torch.tensor([[1, 3, 5 * 4]]))


def test_loader_reports_foreign_and_missing_tensors(audio_pair):
    reference, _ = audio_pair
    fresh = build_audio_encoder(AudioEncoderConfig.from_hf(TINY_AUDIO), torch.float32)
    named = [(AUDIO_PREFIX + k, v) for k, v in reference.state_dict().items() if not k.startswith("proj2.")]
    named.append((AUDIO_PREFIX + "bogus.weight", torch.zeros(1)))
    named.append(("thinker.model.layers.0.mlp.gate.weight", torch.zeros(1)))  # another component: skipped
    with pytest.raises(ValueError, match=r"bogus\.weight.*proj2\.weight"):
        load_encoder(fresh, None, tensors=named)


def test_dummy_weights_and_full_configs():
    audio = build_audio_encoder(AudioEncoderConfig.from_hf(TINY_AUDIO), torch.float32)
    load_encoder(audio, None, load_format="dummy")
    assert torch.equal(audio.ln_post.weight, torch.ones_like(audio.ln_post.weight))
    feats = log_mel_features(_audios()[1:])
    with torch.no_grad():
        out = audio(feats.features, feats.lengths)
    assert out.shape == (8, TINY_AUDIO["output_dim"]) and torch.isfinite(out).all() and out.std() > 0
    bf16 = load_encoder(build_audio_encoder(audio.config, torch.bfloat16), None, load_format="dummy")
    assert torch.equal(bf16.conv_out.weight, audio.conv_out.weight.to(torch.bfloat16))  # same draw, rounded
    full_a, full_v = full_audio_config(), full_vision_config()
    assert (full_a.d_model, full_a.num_layers, full_a.output_dim, full_a.conv_out_features) == (
        1280,
        32,
        2048,
        7680,
    )
    assert (full_v.hidden_size, full_v.depth, full_v.out_hidden_size, full_v.head_dim) == (1152, 27, 2048, 72)
    assert full_v.deepstack_visual_indexes == (8, 16, 24) and full_v.patch_dim == 1536
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        VisionEncoderConfig.from_hf({**TINY_VISION, "deepstack_visual_indexes": [5]})
    with pytest.raises(ValueError, match="n_window_infer"):
        AudioEncoderConfig.from_hf({**TINY_AUDIO, "n_window_infer": 150})
