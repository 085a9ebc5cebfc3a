"""Wan2.2 with FP8 DiT weights (`quantization: {dit: fp8}`): which linears are quantized, the DiT's output
against float32 on CPU (the weight-only path, and the W8A8 emulation of what CUDA runs), the weights the
memory plan counts, and the config checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mstar.config import ConfigError, config_from_dict
from mstar.layers import fp8
from mstar.layers.fp8 import Fp8Linear
from mstar.models.common.loading import fill_dummy_weights
from mstar.models.wan22.config import WanTransformerConfig
from mstar.models.wan22.tiny import TINY_TRANSFORMER
from mstar.models.wan22.transformer import build_transformer
from mstar.runtime.build import build_model

# Wider than the tiny DiT so each projection sums over enough terms for its rounding error to average out
# as it does at full size (the tiny one's 24-wide rows make the error a few large terms).
CONFIG = WanTransformerConfig.from_hf({**TINY_TRANSFORMER, "num_attention_heads": 4, "attention_head_dim": 32,
                                       "ffn_dim": 256, "text_dim": 64, "torch_dtype": "float32"})
BLOCK_LINEARS = {"attn1.to_qkv", "attn1.to_out", "attn2.to_q", "attn2.to_kv", "attn2.to_out", "ffn_in", "ffn_out"}


def _dit(quantization: str | None) -> nn.Module:
    model = build_transformer(CONFIG, torch.float32, "cpu", quantization)
    fill_dummy_weights(model, seed=3, std=0.05)
    return model


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, CONFIG.in_channels, 3, 8, 8, generator=g)
    return latents, torch.tensor([900.0, 250.0]), torch.randn(2, 16, CONFIG.text_dim, generator=g)


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_only_the_blocks_attention_and_ffn_linears_are_fp8():
    model = _dit("fp8")
    quantized = {name for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert quantized == {f"blocks.{i}.{n}" for i in range(CONFIG.num_layers) for n in BLOCK_LINEARS}
    for kept in ("time_proj", "proj_out", "text_embedder.linear_1", "time_embedder.linear_1"):
        assert type(model.get_submodule(kept)) is nn.Linear, kept
    assert model.time_embedder.linear_1.weight.dtype == model.scale_shift_table.dtype == torch.float32


@pytest.mark.parametrize("path", ["weight_only", "w8a8"])
def test_fp8_dit_output_stays_close_to_float32(monkeypatch, path):
    """E4M3 keeps 3 mantissa bits to bfloat16's 7, so FP8 weights err about 16x what bfloat16 weights do
    (relative rounding 2^-4 against 2^-8). The DiT's output error is held to 4x-32x that of the same DiT
    with its block linears rounded to bfloat16, and under 1%; W8A8 (per-token E4M3 activations too, as
    torch._scaled_mm runs on CUDA, emulated by w8a8_reference) adds about half as much again, so its bounds
    are twice the weight-only ones. Measured: 0.33% weight-only (16x bfloat16's 0.021%), 0.46% W8A8 (22x)."""
    if path == "w8a8":
        monkeypatch.setattr(fp8, "fp8_linear", fp8.w8a8_reference)
    ref, quantized = _dit(None), _dit("fp8")
    with torch.no_grad():
        want = ref(*_inputs())
        got = quantized(*_inputs())
        for block in ref.blocks:
            for module in block.modules():
                if isinstance(module, nn.Linear):
                    module.weight.copy_(module.weight.bfloat16())
        bf16_error = _rel_error(ref(*_inputs()), want)
    fp8_error = _rel_error(got, want)
    scale = 2 if path == "w8a8" else 1
    assert 4 * bf16_error < fp8_error < 32 * scale * bf16_error, (fp8_error, bf16_error)
    assert fp8_error < 0.01 * scale, fp8_error


def test_fp8_dummy_dit_is_the_float32_one_quantized():
    ref, quantized = _dit(None), _dit("fp8")
    for name, layer in quantized.named_modules():
        if isinstance(layer, Fp8Linear):
            want = Fp8Linear.from_linear(ref.get_submodule(name), None)
            assert torch.equal(layer.weight.view(torch.uint8), want.weight.view(torch.uint8)), name
            assert torch.equal(layer.weight_scale, want.weight_scale) and torch.equal(layer.bias, want.bias), name


def test_served_component_and_memory_plan_count_fp8_bytes():
    from mstar.runtime import memory_plan

    def weight_bytes(quantization: dict) -> tuple[int, int]:
        config = config_from_dict({"model": "wan22", "model_kwargs": {"dtype": "bfloat16"},
                                   "quantization": quantization})
        (plan,) = memory_plan.plan_memory(config, [64 << 30], tiny=True)
        module = build_model(config, tiny=True).build_component("dit", torch.device("cpu")).module
        built = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
        return next(n.weight_bytes for n in plan.needs if n.name == "dit"), built

    planned, built = weight_bytes({"dit": "fp8"})
    plain, _ = weight_bytes({})
    assert planned == built < plain


@pytest.mark.parametrize("quantization,match", [
    ({"vae": "fp8"}, r"component 'vae' of model 'wan22' cannot be quantized; quantizable: \['dit'\]"),
    ({"text_encoder": "fp8"}, r"component 'text_encoder' .* cannot be quantized"),
    ({"dit": "int4"}, r"quantization.dit='int4': use one of \['fp8', 'fp8_block'\]"),
])
def test_config_validation(quantization, match):
    config = config_from_dict({"model": "wan22", "quantization": quantization}, source="wan.yaml")
    with pytest.raises(ConfigError, match=match):
        build_model(config, tiny=True)
    assert build_model(config_from_dict({"model": "wan22", "quantization": {"dit": "fp8"}}), tiny=True).quantization \
        == {"dit": "fp8"}
