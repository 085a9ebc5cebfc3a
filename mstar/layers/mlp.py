"""Feed-forward blocks: the gated SiLU MLP of Llama-family decoders and the plain GELU MLP of vision
transformers and connectors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.fused import FUSED
from mstar.layers.linear import linear, silu_and_mul_linear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul (`gate_up_proj`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        gate_up = linear(x, self.gate_up_proj)
        ops = FUSED.ops_for(gate_up)
        if ops is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
            return silu_and_mul_linear(gate_up, self.down_proj)  # fused into the GEMV where it wins
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj)


class GeluMLP(nn.Module):
    """fc2(gelu(fc1(x))) with biases: SigLIP's MLP and BAGEL's connector (tanh-approximated GELU) and
    V-JEPA 2's (`approximate="none"`, the exact GELU)."""

    def __init__(self, in_features: int, hidden: int, out_features: int | None = None,
                 approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, in_features if out_features is None else out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]."""
        return linear(F.gelu(linear(x, self.fc1), approximate=self.approximate), self.fc2)
