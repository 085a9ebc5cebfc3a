"""Feed-forward blocks: the gated MLP of Llama-family decoders (SiLU) and of Gemma (tanh GELU), and the
plain GELU MLP of vision transformers and connectors."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from mstar.kernels.guard import KernelGuard
from mstar.layers.fused import FUSED
from mstar.layers.linear import gemm_gelu, gemm_gelu_serves, linear, silu_and_mul_linear

_GELU_AND_MUL = KernelGuard("GELU-and-mul")


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul (`gate_up_proj`); `act` is SiLU
    (Llama, Qwen) or `gelu_tanh`, tanh-approximated GELU (Gemma)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: Literal["silu", "gelu_tanh"] = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"GatedMLP activation must be 'silu' or 'gelu_tanh', got {activation!r}")
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden], over x's rows as 2-D matmuls (so `linear` and the fused
        kernels see the row count they are chosen by)."""
        out = self._down(linear(x.reshape(-1, x.shape[-1]), self.gate_up_proj))
        return out.view(*x.shape[:-1], out.shape[-1])

    def _down(self, gate_up: torch.Tensor) -> torch.Tensor:
        ops = FUSED.ops_for(gate_up)
        if ops is not None and gate_up.is_contiguous():
            if self.activation == "silu":
                return silu_and_mul_linear(gate_up, self.down_proj)  # fused into the GEMV where it wins
            act = _GELU_AND_MUL.run(lambda: ops.gelu_and_mul(gate_up), lambda: None)
            if act is not None:
                return linear(act, self.down_proj)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return linear(act * up, self.down_proj)


class GeluMLP(nn.Module):
    """fc2(gelu(fc1(x))) with biases: SigLIP's MLP and BAGEL's connector (tanh-approximated GELU) and
    V-JEPA 2's (`approximate="none"`, the exact GELU).

    With `gemm_epilogue`, where `gemm_gelu_serves` (CUDA bf16/fp16, fc1 an nn.Linear) fc1's bias and GELU run
    in the GEMM's cuBLASLt epilogue (`gemm_gelu`), so the [..., hidden] activation is written once and never
    re-read by a GELU kernel. That GELU is the tanh approximation whatever `approximate` says: a model opts in
    only where that was measured to be lost in its dtype's rounding (V-JEPA 2: models/vjepa2/layers.py)."""

    def __init__(self, in_features: int, hidden: int, out_features: int | None = None,
                 approximate: str = "tanh", gemm_epilogue: bool = False) -> None:
        super().__init__()
        self.approximate, self.gemm_epilogue = approximate, gemm_epilogue
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, in_features if out_features is None else out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]."""
        if self.gemm_epilogue and gemm_gelu_serves(x.device, x.dtype, self.fc1):
            h = gemm_gelu(x, self.fc1.weight, self.fc1.bias)
        else:
            h = F.gelu(linear(x, self.fc1), approximate=self.approximate)
        return linear(h, self.fc2)
