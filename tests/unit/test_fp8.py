"""FP8 weights (layers/fp8.py): the quantize/dequantize formulas against a reference written out here,
the emulated linear, swapping a module's linears, and the `quantization` setting (YAML and CLI)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mstar.config import ConfigError, config_from_dict
from mstar.layers import fp8
from mstar.layers.fp8 import (
    FP8_DTYPE,
    Fp8Linear,
    dequantize,
    fp8_linear,
    quantize_blocks,
    quantize_linears,
    quantize_per_channel,
    w8a8_reference,
)
from mstar.layers.linear import linear

E4M3_MAX = 448.0


def _reference_quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q = saturate(w / s) in E4M3, s broadcast over w."""
    return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _within_e4m3_rounding(w: torch.Tensor, dq: torch.Tensor, scale: torch.Tensor) -> bool:
    """|dq - w| within half an E4M3 step: 2^-4 relative for normals, 2^-10 * s for subnormals."""
    return bool(((dq - w).abs() <= w.abs() / 16 + scale * 2.0**-10 + 1e-12).all())


def test_per_channel_matches_the_reference_formula():
    torch.manual_seed(0)
    w = torch.randn(96, 80) * torch.logspace(-3, 1, 96)[:, None]  # rows of very different ranges
    q, scale = quantize_per_channel(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (96, 1)
    assert torch.equal(scale, w.abs().amax(dim=1, keepdim=True) / E4M3_MAX)
    assert torch.equal(_bits(q), _bits(_reference_quantize(w, scale)))
    dq = dequantize(q, scale, None)
    assert torch.equal(dq, q.float() * scale)
    assert _within_e4m3_rounding(w, dq, scale)
    assert torch.allclose(dq.abs().amax(dim=1), w.abs().amax(dim=1), rtol=1e-6)  # a row amax is 448 * s


def test_blocks_match_the_reference_formula_with_ragged_edges():
    torch.manual_seed(1)
    w = torch.randn(300, 200, dtype=torch.bfloat16)  # 300 = 2 * 128 + 44 rows, 200 = 128 + 72 columns
    q, scale = quantize_blocks(w, (128, 128))
    assert scale.shape == (3, 2)
    full = torch.empty(300, 200)
    for i in range(3):
        for j in range(2):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            assert scale[i, j] == block.abs().max() / E4M3_MAX
            full[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = scale[i, j]
    assert torch.equal(_bits(q), _bits(_reference_quantize(w, full)))
    dq = dequantize(q, scale, (128, 128))
    assert torch.equal(dq, q.float() * full)
    assert _within_e4m3_rounding(w.float(), dq, full)


def test_zero_rows_and_saturation():
    w = torch.zeros(4, 8)
    w[1] = torch.linspace(-3.0, 3.0, 8)
    q, scale = quantize_per_channel(w)
    assert torch.isfinite(scale).all() and (q[0].float() == 0).all()
    assert q[1].float().abs().max() == E4M3_MAX  # the row's amax maps to E4M3's largest finite value
    qb, sb = quantize_blocks(w, (2, 4))
    assert torch.isfinite(sb).all() and not torch.isnan(qb.float()).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [None, (32, 32)])
def test_the_emulated_linear_is_the_dequantized_weight_in_the_activation_dtype(dtype, block):
    torch.manual_seed(2)
    dense = nn.Linear(64, 48, bias=True).to(dtype)
    fp8 = Fp8Linear.from_linear(dense, block)
    assert fp8.weight.dtype == FP8_DTYPE and fp8.bias.dtype == dtype
    x = torch.randn(5, 64, dtype=dtype)
    want = F.linear(x, (fp8.weight.float() * _expanded(fp8)).to(dtype), dense.bias)
    assert torch.equal(fp8_linear(x, fp8), want)
    assert torch.equal(linear(x, fp8), want)  # the shared entry point dispatches on the module
    assert torch.allclose(fp8(x).float(), dense(x).float(), rtol=0.1, atol=0.1)


def _expanded(fp8: Fp8Linear) -> torch.Tensor:
    if fp8.block is None:
        return fp8.weight_scale
    bn, bk = fp8.block
    return torch.kron(fp8.weight_scale, torch.ones(bn, bk))[:fp8.out_features, :fp8.in_features]


def test_quantize_linears_swaps_linears_and_leaves_tied_weights():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 16), nn.Linear(16, 8))
    model[3] = nn.Linear(8, 8)
    model[3].weight = model[0].weight  # a tied pair: quantizing one would change the other
    assert quantize_linears(model, None) == ["2"]
    assert isinstance(model[2], Fp8Linear) and type(model[0]) is nn.Linear and type(model[3]) is nn.Linear
    assert quantize_linears(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), (4, 4), only={"1"}) == ["1"]


def test_the_quantization_setting_is_validated_per_component():
    from mstar.runtime.build import build_model

    ok = build_model(config_from_dict({"model": "llama", "quantization": {"llm": "fp8_block"}}), tiny=True)
    assert ok.quantization == {"llm": "fp8_block"}
    cases = [
        ({"model": "llama", "quantization": {"llm": "int4"}}, "quantization.llm='int4': use one of ['fp8', 'fp8_block']"),
        ({"model": "llama", "quantization": {"vision": "fp8"}}, "unknown key 'quantization.vision'"),
        ({"model": "toy", "quantization": {"decoder": "fp8"}}, "component 'decoder' of model 'toy' cannot be quantized"),
    ]
    for data, message in cases:
        with pytest.raises(ConfigError) as exc:
            build_model(config_from_dict(data), tiny=True)
        assert message in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="quantization must map components to a method, e.g. {llm: fp8}"):
        config_from_dict({"model": "llama", "quantization": "fp8"})


def test_the_cli_flag_sets_every_quantizable_component_and_the_yaml_wins(tmp_path):
    from mstar.cli import main as cli

    args = cli.build_parser().parse_args(["serve", "orpheus", "--quantization", "fp8"])
    config = cli.apply_quantization_flag(config_from_dict({"model": "orpheus"}), args)
    assert config.quantization == {"llm": "fp8"}
    kept = cli.apply_quantization_flag(config_from_dict({"model": "orpheus", "quantization": {"llm": "fp8_block"}}),
                                       args)
    assert kept.quantization == {"llm": "fp8_block"}
    with pytest.raises(ConfigError, match="model 'toy' has no component that can be quantized"):
        cli.apply_quantization_flag(config_from_dict({"model": "toy"}), args)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "llama", "--quantization", "int4"])


def test_the_w8a8_reference_quantizes_activations_per_token():
    torch.manual_seed(3)
    module = Fp8Linear.from_linear(nn.Linear(64, 32, bias=True), None)
    x = torch.randn(6, 64) * torch.logspace(-2, 1, 6)[:, None]  # tokens of very different ranges
    x_scale = x.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    xq = _reference_quantize(x, x_scale)
    want = (xq.float() * x_scale) @ (module.weight.float() * module.weight_scale).T + module.bias
    got = w8a8_reference(x, module)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    weight_only = fp8_linear(x, module)  # what CPU runs: the activation rounding is the only difference
    assert 0 < (got - weight_only).norm() < 0.05 * weight_only.norm()
    assert not fp8.scaled_mm_serves(x.bfloat16(), module)  # never on CPU


@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32], ids=["no_bias", "bf16", "fp32"])
def test_w8a8_adds_the_bias_in_the_scaled_mm_epilogue(monkeypatch, bias_dtype):
    """`scaled_mm` hands `torch._scaled_mm` the bias in the output dtype, so it is added to the float32 product
    before the one rounding: its result is `_scaled_mm`'s own, no separate add after it, and it matches
    `w8a8_reference` (CPU `_scaled_mm`; a float32 bias is rounded to bfloat16 first, as the reference does)."""
    torch.manual_seed(4)
    dense = nn.Linear(256, 64, bias=bias_dtype is not None).to(bias_dtype or torch.bfloat16)
    module = Fp8Linear.from_linear(dense, None)
    x = torch.randn(40, 256, dtype=torch.bfloat16)
    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((kwargs, out))
        return out

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    got = fp8.scaled_mm(x, module.weight, module.weight_scale, module.bias)
    (kwargs, out), = calls
    assert got is out  # nothing ran on the product after `_scaled_mm`
    if bias_dtype is None:
        assert kwargs.get("bias") is None
    else:
        assert kwargs["bias"].dtype == torch.bfloat16 and torch.equal(kwargs["bias"], module.bias.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, w8a8_reference(x, module))  # bfloat16's default tolerance: one rounding step


def test_the_fp8_kernel_choice_times_the_skinny_dot_kernel_and_keeps_the_fastest(monkeypatch):
    from mstar.layers.linear import SKINNY

    module = Fp8Linear.from_linear(nn.Linear(64, 48).bfloat16(), None)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    timed: list[str] = []

    def fake_time(candidates, weight):  # GPU microseconds per candidate, as `_time` returns them
        timed.extend(candidates)
        return {"gemv": 3.0, "skinny_dot": 2.0} if weight is module.weight else None

    monkeypatch.setattr(SKINNY, "_time", fake_time)
    assert SKINNY._measure_fp8(x, module) == "skinny_dot"
    assert timed == ["gemv", "skinny_dot"]  # no `_scaled_mm` on CPU
    monkeypatch.setattr(SKINNY, "force", None)
    assert SKINNY.fp8_kernel(x, module) is None  # CPU: `fp8_linear`'s own order, nothing measured
    monkeypatch.setattr(SKINNY, "force", True)
    assert SKINNY.fp8_kernel(x, module) == "gemv"


def test_the_fp8_kernel_choice_is_kept_apart_where_scaled_mm_serves_and_where_not(monkeypatch):
    """Rows 9 to 16 share an M bucket; `_scaled_mm` (timed fastest here at 16 rows) must not then run 12 rows,
    which `fp8_linear` gives the weight-only GEMV. CUDA is stood in for: `_decide` told x is on CUDA,
    `_scaled_mm` serving from 16 rows."""
    import mstar.layers.linear as linear_module
    from mstar.layers.linear import SKINNY

    module = Fp8Linear.from_linear(nn.Linear(64, 48).bfloat16(), None)
    decide = SKINNY._decide
    monkeypatch.setattr(SKINNY, "force", None)
    monkeypatch.setattr(SKINNY, "decisions", {})
    monkeypatch.setattr(SKINNY, "_decide", lambda key, is_cuda, measure, on, off: decide(key, True, measure, on, off))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(linear_module, "scaled_mm_serves", lambda x, m: x.shape[0] >= fp8.SCALED_MM_MIN_ROWS)
    fastest = {"scaled_mm": 1.0, "skinny_dot": 2.0, "gemv": 3.0}
    monkeypatch.setattr(SKINNY, "_time", lambda candidates, weight: {name: fastest[name] for name in candidates})
    assert SKINNY.fp8_kernel(torch.randn(16, 64, dtype=torch.bfloat16), module) == "scaled_mm"
    assert SKINNY.fp8_kernel(torch.randn(12, 64, dtype=torch.bfloat16), module) == "skinny_dot"
    assert SKINNY.fp8_kernel(torch.randn(16, 64, dtype=torch.bfloat16), module) == "scaled_mm"
    from benchmarks.decode_step import fp8_choices  # reads the decision keys back

    assert sorted((c["m_bucket"], c["n"], c["k"], c["won"]) for c in fp8_choices()) == [
        (16, 48, 64, "scaled_mm"), (16, 48, 64, "skinny_dot")]


def test_activation_quantization_falls_back_to_the_formula_when_its_kernel_fails(monkeypatch):
    """A quantizer kernel that cannot build (an older Triton) leaves W8A8 on the PyTorch formula, same bits."""
    import mstar.kernels.fp8_quant as fp8_quant
    from mstar.layers import fp8

    def broken(rows):
        raise RuntimeError("cannot compile")

    monkeypatch.setattr(fp8.FUSED, "ops_for", lambda x: object())
    monkeypatch.setattr(fp8_quant, "quantize_rows", broken)
    monkeypatch.setattr(fp8._QUANTIZE_ROWS, "usable", True)
    rows = torch.randn(5, 48, dtype=torch.bfloat16)
    q, s = fp8.quantize_activations(rows)
    want_q, want_s = fp8.quantize_per_channel(rows)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    assert not fp8._QUANTIZE_ROWS.usable
