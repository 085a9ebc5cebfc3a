"""Wan2.2 DiT on a GPU: full-width blocks in bf16 against diffusers, and the full 5B model's memory fit.

Run on the lent machine: `python3 -m pytest -q -m gpu tests/gpu/test_wan22_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from mstar.models.common.loading import fill_dummy_weights
from mstar.models.wan22.config import WanTransformerConfig
from mstar.models.wan22.transformer import build_transformer
from mstar.models.wan22.weights import transformer_mapper

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DIFFUSERS_5B = {"patch_size": [1, 2, 2], "num_attention_heads": 24, "attention_head_dim": 128, "in_channels": 48,
                "out_channels": 48, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 14336, "num_layers": 30,
                "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6}


def test_full_width_blocks_bf16_match_diffusers() -> None:
    """Two full-width (3072) layers, 832x480 x 5 latent frames, per-frame timesteps with frame 0 at 0."""
    pytest.importorskip("diffusers")  # not on the GPU machine unless carried
    from diffusers import WanTransformer3DModel

    from mstar.models.common.loading import load_named_tensors
    from mstar.models.wan22 import denoise

    cfg = {**DIFFUSERS_5B, "num_layers": 2}
    torch.manual_seed(0)
    reference = WanTransformer3DModel(**cfg).to("cuda", torch.bfloat16).eval()
    ours = build_transformer(WanTransformerConfig.from_hf(cfg), torch.bfloat16, "cuda")
    load_named_tensors(ours, reference.state_dict().items(), transformer_mapper(ours.config))
    gen = torch.Generator("cuda").manual_seed(1)
    latents = torch.randn(2, 48, 5, 30, 52, device="cuda", generator=gen, dtype=torch.bfloat16)
    text = torch.randn(2, 512, 4096, device="cuda", generator=gen, dtype=torch.bfloat16)
    frame_ts = torch.stack([denoise.frame_timesteps(t, 5, True, "cuda") for t in (999, 500)])
    with torch.no_grad():
        expected = reference(latents, denoise.token_timesteps(frame_ts, 15 * 26), text, return_dict=False)[0]
        got = ours(latents, frame_ts, text)
    err = (got.float() - expected.float()).abs().max().item()
    assert err < 0.05 * expected.float().abs().max().item(), err


def test_full_5b_dummy_forward_fits_and_is_finite() -> None:
    """The full TI2V-5B DiT in bf16 with dummy weights: 832x480, 33 frames (9 latent frames), CFG batch 2."""
    model = build_transformer(WanTransformerConfig(), torch.bfloat16, "cuda")
    fill_dummy_weights(model)
    params = sum(p.numel() for p in model.parameters())
    assert 4.5e9 < params < 5.5e9, params
    latents = torch.randn(2, 48, 9, 30, 52, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(2, 512, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = model(latents, torch.tensor([999.0, 999.0], device="cuda"), text)
    assert out.shape == latents.shape and torch.isfinite(out).all()
