"""RMS normalisation as used by Llama-family decoders, and `PendingNorm`: a norm the next linear may
fold into its GEMV (`mstar.layers.linear.linear`)."""

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


class PendingNorm:
    """`norm(x + residual)` (or `norm(x)`) not computed yet, handed to a module whose first use of its input
    is `linear(...)`: that call folds the norm into the skinny GEMV's x-load where it wins and otherwise
    computes it with the norm kernel (`materialize`). `summed()` is x + residual (x without one): the
    residual stream for what follows. Use it once; only `linear`, `shape`, `dtype`, `device` read it.
    """

    def __init__(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        self.norm, self.x, self.residual = norm, x, residual
        self._normed: torch.Tensor | None = None
        self._summed: torch.Tensor | None = x if residual is None else None

    @property
    def shape(self) -> torch.Size:
        """The shape of x (and of the normed rows)."""
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of x."""
        return self.x.dtype

    @property
    def device(self) -> torch.device:
        """The device of x."""
        return self.x.device

    def materialize(self) -> torch.Tensor:
        """The normed rows, computed as `RMSNorm.forward` / `add_forward` would (once)."""
        if self._normed is None:
            if self.residual is None:
                self._normed = self.norm(self.x)
            else:
                self._normed, self._summed = self.norm.add_forward(self.x, self.residual)
        return self._normed

    def set_summed(self, summed: torch.Tensor | None) -> None:
        """Record x + residual as written by a fused GEMV (None when there was no residual)."""
        if self.residual is not None:
            assert summed is not None, "a fused GEMV over x + residual must return the sum"
            self._summed = summed

    def summed(self) -> torch.Tensor:
        """x + residual (x when there is none), materialising the norm if no linear consumed it yet."""
        if self._summed is None:
            self.materialize()
        assert self._summed is not None
        return self._summed
