"""Qwen3-Omni features equal the checkpoint's processors (transformers' WhisperFeatureExtractor and Qwen2-VL
image processor, configured like Qwen/Qwen3-Omni-30B-A3B-Instruct's preprocessor_config); videos keep the
Qwen2-VL video processor's grids and timing, and their patches are the image processor's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.signal import resample_poly

from mstar.models.qwen3_omni.features import (
    MelSpec,
    VisionPreprocessSpec,
    log_mel_features,
    mel_filter_bank,
    preprocess_images,
    preprocess_videos,
    sample_frame_indices,
    smart_resize,
)

CHECKPOINT_VISION = dict(  # preprocessor_config.json of the checkpoint
    min_pixels=3136,
    max_pixels=12845056,
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)
# Small video bounds keep the test fast; the geometry code is the same as with the processor's defaults.
VIDEO_SPEC = VisionPreprocessSpec(video_min_pixels=64 * 64, video_max_pixels=96 * 128)


def _whisper():
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=16000,
        hop_length=160,
        n_fft=400,
        chunk_length=300,
        padding_value=0.0,
        return_attention_mask=True,
    )


def _reference_mel(waveforms: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """What Qwen3OmniMoeProcessor hands the thinker: valid frames concatenated, and their counts."""
    out = _whisper()(
        waveforms,
        sampling_rate=16000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    mask = out["attention_mask"].bool()
    return out["input_features"].permute(0, 2, 1)[mask].permute(1, 0), mask.sum(-1)


def _tone(seconds: float, rate: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    return (0.4 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def test_mel_filter_bank_matches_transformers():
    from transformers.audio_utils import mel_filter_bank as reference

    expected = reference(
        num_frequency_bins=201,
        num_mel_filters=128,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=16000,
        norm="slaney",
        mel_scale="slaney",
    )
    np.testing.assert_allclose(mel_filter_bank(MelSpec()), expected, rtol=1e-12, atol=1e-15)


def test_log_mel_single_and_batched_16k_equal_whisper_extractor():
    long, short = _tone(2.51, 16000, 0), _tone(0.43, 16000, 1)[:6883]  # lengths not multiples of the hop
    for batch in ([long], [short], [long, short]):
        expected, lengths = _reference_mel(batch)
        ours = log_mel_features(batch)
        assert ours.lengths.tolist() == lengths.tolist()
        assert ours.features.shape == expected.shape
        torch.testing.assert_close(ours.features, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rate", [44100, 8000])
def test_log_mel_resamples_other_rates_and_mixes_down_stereo(rate):
    stereo = np.stack([_tone(1.3, rate, 2), _tone(1.3, rate, 3)], axis=1)
    mono = stereo.mean(axis=1, dtype=np.float32)
    at_16k = resample_poly(mono, 16000 // np.gcd(rate, 16000), rate // np.gcd(rate, 16000)).astype(np.float32)
    expected, lengths = _reference_mel([at_16k])
    ours = log_mel_features([stereo], sample_rates=rate)
    assert ours.lengths.tolist() == lengths.tolist() == [len(at_16k) // 160]
    torch.testing.assert_close(ours.features, expected, atol=1e-5, rtol=0)


def test_log_mel_rejects_bad_inputs():
    with pytest.raises(ValueError, match="too short"):
        log_mel_features([np.zeros(150, np.float32)])
    with pytest.raises(ValueError, match="sample rates"):
        log_mel_features([np.zeros(16000, np.float32)], sample_rates=[16000, 8000])
    with pytest.raises(ValueError, match="frames, channels"):
        log_mel_features([np.zeros((2, 3, 4), np.float32)])


def _image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**CHECKPOINT_VISION)


def test_images_equal_qwen2vl_image_processor():
    rng = np.random.default_rng(0)
    images = [
        rng.integers(0, 256, (45, 70, 3), dtype=np.uint8),
        rng.integers(0, 256, (100, 64, 3), dtype=np.uint8),
    ]
    expected = _image_processor()(images=images, return_tensors="pt")
    ours = preprocess_images(images)
    assert ours.grid_thw.tolist() == expected["image_grid_thw"].tolist() == [[1, 4, 6], [1, 6, 4]]
    torch.testing.assert_close(ours.pixel_values, expected["pixel_values"], atol=1e-6, rtol=0)
    assert ours.num_tokens() == [6, 6]


def test_smart_resize_bounds_and_rounding():
    assert smart_resize(45, 70, 32, 3136, 12845056) == (64, 96)  # 32x64 is under min_pixels
    assert smart_resize(10, 10, 32, 3136, 12845056) == (64, 64)  # upscaled to min_pixels
    h, w = smart_resize(4000, 3000, 32, 3136, 1024 * 1024)  # downscaled under max_pixels
    assert h * w <= 1024 * 1024 and h % 32 == 0 and w % 32 == 0 and h > w
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300, 32, 3136, 12845056)


def test_video_patches_of_still_frames_equal_the_image_patches():
    """Layout check that needs no torchvision: at a grid-aligned size nothing is resized, so a video of
    two equal frames patchifies exactly like the image (whose frame the processor repeats)."""
    frame = np.random.default_rng(1).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    spec = VisionPreprocessSpec(video_min_pixels=64 * 96, video_max_pixels=64 * 96)
    video = preprocess_videos([np.stack([frame, frame])], spec=spec)
    image = _image_processor()(images=[frame], return_tensors="pt")
    assert video.grid_thw.tolist() == image["image_grid_thw"].tolist() == [[1, 4, 6]]
    torch.testing.assert_close(video.pixel_values, image["pixel_values"], atol=1e-6, rtol=0)
    assert video.second_per_grid == (2.0,)


def test_frame_sampling_rule():
    assert sample_frame_indices(9, 6.0, 4.0).tolist() == [0, 1, 3, 4, 6, 7]  # 1.5 s at 4 fps: 6 frames
    assert sample_frame_indices(100, 25.0, 2.0).tolist() == [0, 12, 25, 37, 50, 62, 75, 87]
    assert sample_frame_indices(3, 30.0, 1.0).tolist() == [0, 1]  # at least min_frames, at most all, even
    with pytest.raises(ValueError, match="positive"):
        sample_frame_indices(10, 0.0, 2.0)


def test_video_grids_and_timing_are_those_of_the_qwen2vl_video_processor():
    """The grids and seconds per temporal patch transformers' Qwen2-VL video processor gives these videos.
    Its pixel values need torchvision, whose PyPI build needs CUDA torch (it does not load beside CPU torch):
    pixels are compared only where the image processor gives the same ones (the still-frames test above)."""
    video = np.random.default_rng(2).integers(0, 256, (9, 40, 56, 3), dtype=np.uint8)
    every = preprocess_videos([video], spec=VIDEO_SPEC)  # every frame; 9 -> last frame repeated to 10
    assert every.grid_thw.tolist() == [[5, 4, 6]] and every.pixel_values.shape == (5 * 4 * 6, 3 * 2 * 16 * 16)
    sampled = preprocess_videos([video], video_fps=[6.0], fps=4, spec=VIDEO_SPEC)  # 1.5 s at 4 fps: 6 frames
    assert sampled.grid_thw.tolist() == [[3, 4, 6]] and sampled.second_per_grid == (0.5,)


def test_vision_inputs_reject_bad_arrays():
    with pytest.raises(ValueError, match="uint8 RGB"):
        preprocess_images([np.zeros((32, 32, 3), np.float32)])
    with pytest.raises(ValueError, match=r"\(T, H, W, 3\)"):
        preprocess_videos([np.zeros((32, 32, 3), np.uint8)])
    with pytest.raises(ValueError, match="video_fps"):
        preprocess_videos([np.zeros((4, 32, 32, 3), np.uint8)], fps=2.0)
