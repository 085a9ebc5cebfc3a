"""RMS normalisation as used by Llama-family decoders."""

from __future__ import annotations

import torch
from torch import nn

from mstar.layers.fused import FUSED


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 and returned in the input dtype (matches HF Llama).

    On CUDA a fused Triton kernel does the work (see `mstar.layers.fused`).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = FUSED.ops_for(x)
        if ops is not None and x.dim() == 2 and x.stride(1) == 1 and x.dtype == self.weight.dtype:
            return ops.rms_norm(x, self.weight, self.eps)[0]
        return self._reference(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add fused with the next norm."""
        ops = FUSED.ops_for(x)
        if ops is not None and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() \
                and x.dtype == self.weight.dtype == residual.dtype:
            normed, summed = ops.rms_norm(x, self.weight, self.eps, residual)
            return normed, summed
        summed = x + residual
        return self._reference(summed), summed

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
