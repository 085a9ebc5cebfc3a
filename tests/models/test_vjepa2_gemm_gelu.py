"""V-JEPA 2's MLP takes fc1's GELU from the GEMM epilogue (`layers.linear.gemm_gelu`) where it serves (CUDA
bf16/fp16), and keeps the exact-GELU form elsewhere; the choice is checked on CPU without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers import mlp
from mstar.layers.fp8 import Fp8Linear
from mstar.layers.linear import gemm_gelu_serves
from mstar.models.vjepa2.layers import Block
from mstar.models.vjepa2.tiny import tiny_ac_config

CUDA = torch.device("cuda")


def test_the_epilogue_serves_cuda_bf16_and_fp16_linears_only() -> None:
    bf16 = nn.Linear(16, 32).bfloat16()
    assert gemm_gelu_serves(CUDA, torch.bfloat16, bf16)
    assert gemm_gelu_serves(CUDA, torch.float16, nn.Linear(16, 32).half())
    assert not gemm_gelu_serves(torch.device("cpu"), torch.bfloat16, bf16)
    assert not gemm_gelu_serves(CUDA, torch.float32, nn.Linear(16, 32))
    assert not gemm_gelu_serves(CUDA, torch.float16, bf16)  # weight and activations must share the dtype
    assert not gemm_gelu_serves(CUDA, torch.bfloat16, nn.Linear(16, 32, bias=False).bfloat16())
    float_bias = nn.Linear(16, 32).bfloat16()
    float_bias.bias.data = float_bias.bias.data.float()  # _addmm_activation wants the bias in the GEMM's dtype
    assert not gemm_gelu_serves(CUDA, torch.bfloat16, float_bias)
    assert not gemm_gelu_serves(CUDA, torch.bfloat16, Fp8Linear.from_linear(bf16, None))


def test_vjepa2_blocks_opt_in_and_other_gelu_mlps_do_not() -> None:
    block = Block(tiny_ac_config().vit)
    assert block.mlp.gemm_epilogue and block.mlp.approximate == "none"
    assert not mlp.GeluMLP(16, 32).gemm_epilogue  # SigLIP, BAGEL's connector: unchanged


def test_the_mlp_runs_gemm_gelu_where_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the epilogue said to serve, fc1 goes through `gemm_gelu` (its CPU form is the erf GELU of
    addmm, so the result is compared with that), and otherwise through the exact-GELU reference."""
    torch.manual_seed(0)
    module = mlp.GeluMLP(16, 40, approximate="none", gemm_epilogue=True)
    x = torch.randn(2, 5, 16)
    calls: list[torch.Size] = []
    real = mlp.gemm_gelu

    def spy(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape)
        return real(rows, weight, bias)

    monkeypatch.setattr(mlp, "gemm_gelu", spy)
    with torch.no_grad():
        reference = module.fc2(F.gelu(module.fc1(x)))
        assert torch.equal(module(x), reference) and not calls  # CPU: the reference path
        monkeypatch.setattr(mlp, "gemm_gelu_serves", lambda device, dtype, linear: linear is module.fc1)
        got = module(x)
    assert calls == [x.shape]
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
