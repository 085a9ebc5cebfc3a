"""RMS normalisation as used by Llama-family decoders; a residual add fused with the LayerNorm after it
(`add_layer_norm`, for the pre-norm ViTs: SigLIP, V-JEPA 2)."""

from __future__ import annotations

import torch
from torch import nn

from mstar.kernels.guard import KernelGuard
from mstar.layers.fused import FUSED

ADD_LAYER_NORM = KernelGuard("add + layer norm")


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


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor | None, norm: nn.LayerNorm
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm(s)) with s = x + delta (x itself when delta is None), rounded as the eager ops round. One
    kernel (`fused_ops.layer_norm`) where the fused kernels serve x; the eager ops elsewhere (CPU)."""

    def eager() -> tuple[torch.Tensor, torch.Tensor]:
        s = x if delta is None else x + delta
        return s, norm(s)

    ops = FUSED.ops_for(x)
    if ops is None or not x.is_contiguous() or x.dtype != norm.weight.dtype or norm.bias is None \
            or (delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype or not delta.is_contiguous())):
        return eager()
    width = x.shape[-1]

    def fused() -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.view(-1, width)
        normed, s = ops.layer_norm(rows, norm.weight, norm.bias, norm.eps, delta.view(-1, width) if delta is not None
                                   else None)
        return (x if s is None else s.view(x.shape)), normed.view(x.shape)

    return ADD_LAYER_NORM.run(fused, eager)
