"""The Wan DiT's self-attention through FlashInfer's FA3 kernel (wan22 `attention: flashinfer`) gives
SDPA's result within bf16 rounding, alone and inside a DiT forward.

Run on the lent machine: `python3 -m pytest -q -m gpu tests/gpu/test_wan22_attention_gpu.py`
(needs the flashinfer wheel carried: benchmarks/device_setup.sh).
"""

from __future__ import annotations

import pytest
import torch

from mstar.models.common.loading import fill_dummy_weights
from mstar.models.wan22.config import WanTransformerConfig
from mstar.models.wan22.tiny import TINY_TRANSFORMER
from mstar.models.wan22.transformer import build_transformer, flashinfer_attention, sdpa_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs an sm_90+ GPU"),
]
pytest.importorskip("flashinfer")


def test_flashinfer_attention_matches_sdpa_with_a_strided_v() -> None:
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(2, 700, 4, 128, device="cuda", generator=g).bfloat16()
    kv = torch.randn(2, 700, 3, 4, 128, device="cuda", generator=g).bfloat16()
    k, v = kv[:, :, 0], kv[:, :, 2]  # v strided along tokens, as the DiT's fused QKV hands it over
    got = flashinfer_attention(q, k, v)
    want = sdpa_attention(q, k, v)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_dit_forward_with_flashinfer_matches_sdpa() -> None:
    # the tiny DiT with heads of 128 (FA3's head sizes are 64, 128, 256)
    config = WanTransformerConfig.from_hf({**TINY_TRANSFORMER, "attention_head_dim": 128, "torch_dtype": "float32"})
    torch.manual_seed(0)
    model = build_transformer(config, torch.bfloat16, "cuda")
    fill_dummy_weights(model, std=0.05)
    gen = torch.Generator("cuda").manual_seed(1)
    latents = torch.randn(2, 16, 3, 8, 12, device="cuda", generator=gen)
    text = torch.randn(2, 16, config.text_dim, device="cuda", generator=gen)
    timestep = torch.tensor([900.0, 500.0], device="cuda")
    with torch.inference_mode():
        want = model(latents, timestep, text)
        model.use_attention("flashinfer")
        got = model(latents, timestep, text)
        model.use_attention("sdpa")
        again = model(latents, timestep, text)
    torch.testing.assert_close(again, want, atol=0, rtol=0)
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
    assert (got.float() - want.float()).abs().mean() < 1e-2
