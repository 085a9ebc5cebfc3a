"""Qwen3-Omni encoders at full size on CUDA: float32 parity with transformers' towers (random weights),
and bf16 dummy-weight runs on realistic inputs (30 s of audio, a 448x448 image, an 8-frame video)."""

from __future__ import annotations

import numpy as np
import torch

from mstar.models.qwen3_omni.audio_encoder import audio_output_lengths
from mstar.models.qwen3_omni.encoder_config import (
    FULL_AUDIO,
    FULL_VISION,
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
from mstar.models.qwen3_omni.features import log_mel_features, preprocess_images, preprocess_videos

CUDA = torch.device("cuda")


def _audio_features():
    rng = np.random.default_rng(0)
    return log_mel_features(
        [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in (16000 * 30, 16000 * 7 + 555)]
    )


def _vision_inputs():
    rng = np.random.default_rng(1)
    image = preprocess_images([rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)])
    video = preprocess_videos([rng.integers(0, 256, (8, 360, 640, 3), dtype=np.uint8)])
    return torch.cat([image.pixel_values, video.pixel_values]), torch.cat([image.grid_thw, video.grid_thw])


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max())


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def _randomise(module: torch.nn.Module) -> None:
    gen = torch.Generator(device=CUDA).manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 1.0 if name.endswith("weight") and p.ndim == 1 else 0.0
            p.copy_(torch.randn(p.shape, generator=gen, device=CUDA) * 0.02 + scale)


def test_full_audio_encoder_float32_equals_reference():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    reference = Qwen3OmniMoeAudioEncoder(Qwen3OmniMoeAudioEncoderConfig(**FULL_AUDIO)).to(CUDA).eval()
    _randomise(reference)
    ours = build_audio_encoder(full_audio_config(), torch.float32, CUDA)
    load_encoder(ours, None, tensors=[(AUDIO_PREFIX + k, v) for k, v in reference.state_dict().items()])
    feats = _audio_features()
    with torch.no_grad():
        expected = reference(feats.features.to(CUDA), feats.lengths.to(CUDA)).last_hidden_state
        got = ours(feats.features.to(CUDA), feats.lengths)
    assert got.shape == (sum(audio_output_lengths(feats.lengths.tolist(), ours.config)), 2048)
    assert _relative_error(got, expected) < 1e-3


def test_full_vision_encoder_float32_equals_reference():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeVisionEncoderConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    reference = Qwen3OmniMoeVisionEncoder(Qwen3OmniMoeVisionEncoderConfig(**FULL_VISION)).to(CUDA).eval()
    _randomise(reference)
    ours = build_vision_encoder(full_vision_config(), torch.float32, CUDA)
    load_encoder(ours, None, tensors=[(VISION_PREFIX + k, v) for k, v in reference.state_dict().items()])
    pixels, grid_thw = _vision_inputs()
    with torch.no_grad():
        expected = reference(pixels.to(CUDA), grid_thw.to(CUDA))
        got = ours(pixels.to(CUDA), grid_thw)
    assert _relative_error(got.embeds, expected.pooler_output) < 1e-3
    for ours_tap, ref_tap in zip(got.deepstack, expected.deepstack_features, strict=True):
        assert _relative_error(ours_tap, ref_tap) < 1e-3


def test_full_encoders_bf16_dummy_weights_track_float32():
    feats = _audio_features()
    pixels, grid_thw = _vision_inputs()
    outputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        audio = load_encoder(build_audio_encoder(full_audio_config(), dtype, CUDA), None, load_format="dummy")
        vision = load_encoder(
            build_vision_encoder(full_vision_config(), dtype, CUDA), None, load_format="dummy"
        )
        with torch.no_grad():
            outputs[dtype] = (
                audio(feats.features.to(CUDA), feats.lengths),
                vision(pixels.to(CUDA), grid_thw),
            )
        del audio, vision
    (a32, v32), (a16, v16) = outputs[torch.float32], outputs[torch.bfloat16]
    assert a16.dtype == v16.embeds.dtype == torch.bfloat16
    assert torch.isfinite(a16).all() and torch.isfinite(v16.embeds).all()
    # bf16 rounding through 32 (27) layers: the direction of the output is what must survive
    assert _cosine(a16, a32) > 0.99
    assert _cosine(v16.embeds, v32.embeds) > 0.99
    assert v16.embeds.shape[0] == int(grid_thw.prod(-1).sum()) // 4 and len(v16.deepstack) == 3
