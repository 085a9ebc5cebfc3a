"""Full-size Wan2.2 VAE on CUDA: parity with Diffusers, and chunked decoding bounding memory.

Run on a GPU machine: `python3 -m pytest -q -m gpu tests/gpu/test_wan22_vae_gpu.py -s`.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from mstar.models.wan22.vae import WanVAE  # noqa: E402
from mstar.models.wan22.vae_config import WAN22_TI2V_5B_VAE  # noqa: E402

logger = logging.getLogger(__name__)
DEVICE = torch.device("cuda")


@pytest.fixture
def exact_float32():
    # TF32 would make float32 convolutions differ by ~1e-3 between any two implementations.
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def test_full_size_matches_diffusers_float32(exact_float32):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    ours = WanVAE(WAN22_TI2V_5B_VAE).to(DEVICE).eval()  # PyTorch's default init: realistic activations
    kwargs = {k: v for k, v in WAN22_TI2V_5B_VAE.to_hf().items() if not k.startswith("_")}
    ref = diffusers.AutoencoderKLWan(**kwargs).to(DEVICE).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    shape = (1, 48, 1, 1, 1)
    mean = torch.tensor(WAN22_TI2V_5B_VAE.latents_mean, device=DEVICE).view(shape)
    std = torch.tensor(WAN22_TI2V_5B_VAE.latents_std, device=DEVICE).view(shape)
    video = torch.rand(1, 3, 5, 128, 160, device=DEVICE) * 2 - 1
    with torch.no_grad():
        expected_latents = (ref.encode(video).latent_dist.mode() - mean) / std
        latents = ours.encode(video)
        torch.testing.assert_close(latents, expected_latents, atol=1e-3, rtol=1e-3)
        expected_video = ref.decode(latents * std + mean).sample
    torch.testing.assert_close(ours.decode(latents), expected_video, atol=1e-3, rtol=1e-3)


def _peak_decode(vae: WanVAE, latents: torch.Tensor, chunk_frames: int | None) -> tuple[torch.Tensor, int, float]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    video = vae.decode(latents, chunk_frames=chunk_frames)
    torch.cuda.synchronize()
    return video, torch.cuda.max_memory_allocated() - base, time.perf_counter() - start


def test_chunked_decode_832x480x33_bf16_bounds_memory():
    from mstar.models.wan22.vae_weights import load_vae

    vae = load_vae(load_format="dummy", dtype=torch.bfloat16, device=DEVICE)
    latents = torch.randn(1, 48, *vae.latent_shape(33, 480, 832)[1:], device=DEVICE)
    _peak_decode(vae, latents[:, :, :2], 1)  # warm-up: cuDNN algorithm choice
    chunked, chunked_peak, chunked_s = _peak_decode(vae, latents, 1)
    whole, whole_peak, whole_s = _peak_decode(vae, latents, None)
    logger.warning(
        "decode 33x480x832 bf16: chunked %.2f s, peak %.2f GiB; whole %.2f s, peak %.2f GiB",
        chunked_s, chunked_peak / 2**30, whole_s, whole_peak / 2**30,
    )
    assert chunked.shape == (1, 3, 33, 480, 832)
    assert torch.isfinite(chunked).all()
    assert chunked_peak < whole_peak / 2  # streaming one latent frame at a time is what bounds memory
    # bf16 rounding differs between the two schedules; they must still agree closely.
    assert (chunked - whole).abs().mean() < 2e-2


def test_bf16_decode_close_to_float32_at_full_width(exact_float32):
    """The `vae_dtype: bfloat16` serving option against the float32 decode, same (default-init) weights, a
    5-frame 128x160 video: logs the error; bounds it loosely (not yet measured at full width; the tiny
    CPU test saw ~0.004 mean, ~0.04 max on the [-1, 1] scale)."""
    from mstar.models.wan22.vae import frames_to_uint8

    torch.manual_seed(0)
    vae32 = WanVAE(WAN22_TI2V_5B_VAE).to(DEVICE).eval()
    vae16 = WanVAE(WAN22_TI2V_5B_VAE).to(DEVICE, torch.bfloat16).eval()
    vae16.load_state_dict(vae32.state_dict())
    latents = torch.randn(1, 48, 2, 8, 10, device=DEVICE)
    want, got = vae32.decode(latents), vae16.decode(latents)
    diff = (got - want).abs()
    levels = (frames_to_uint8(got).int() - frames_to_uint8(want).int()).abs()
    logger.warning("bf16 vs float32 decode: mean %.4f max %.4f (signal mean |x| %.3f); uint8 levels mean %.2f max %d",
                   diff.mean(), diff.max(), want.abs().mean(), levels.float().mean(), levels.max())
    assert torch.isfinite(got).all()
    assert 0 < diff.mean() < 0.05 and levels.float().mean() < 6
