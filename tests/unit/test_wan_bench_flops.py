"""The DiT FLOP count behind benchmarks/wan_bench.py's floor, checked against torch's FLOP counter."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.wan_bench import dit_attention_flops, dit_flops
from mstar.models.wan22.config import WanTransformerConfig
from mstar.models.wan22.tiny import TINY_TRANSFORMER
from mstar.models.wan22.weights import build_transformer


def test_projection_flops_match_the_counted_matmuls_of_a_forward():
    config = WanTransformerConfig.from_hf({**TINY_TRANSFORMER, "torch_dtype": "float32", "num_attention_heads": 4,
                                           "attention_head_dim": 16, "ffn_dim": 96})
    dit = build_transformer(config, torch.float32, torch.device("cpu"))
    latent, text_length = (3, 8, 12), 16
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        dit(torch.randn(1, config.in_channels, *latent), torch.full((1, 3), 500.0),
            torch.randn(1, text_length, config.text_dim))
    counts = counter.get_flop_counts()["Global"]
    matmuls = sum(v for k, v in counts.items() if "mm" in str(k))  # attention kernels are not counted on CPU
    projections = dit_flops(config, latent, text_length) - dit_attention_flops(config, latent, text_length)
    # the formula leaves out the per-frame timestep MLPs: a few percent at this tiny width, ~0 at full size
    assert 0.97 * matmuls < projections <= matmuls


def test_full_size_forward_is_about_36_tflop():
    flops = dit_flops(WanTransformerConfig(), (9, 30, 52), 512)  # 832x480, 33 frames: 3510 video tokens
    assert 35e12 < flops < 37.5e12
