"""Which tensors the fused Triton kernels (`mstar/kernels/fused_ops.py`) serve.

They run for CUDA tensors when triton imports (and for CPU tensors under TRITON_INTERPRET=1, for
tests); MSTAR_FUSED_KERNELS=0 turns them off (the PyTorch code in the layers is the reference).
`norm_linear` (MSTAR_FUSE_NORM_LINEAR=1) lets decoder layers hand an RMSNorm to the next projection
un-applied (`mstar.layers.norm.PendingNorm`), for the skinny GEMV to fold in where timing says so.
The switches are read once per process; tests flip `FUSED.enabled` / `FUSED.norm_linear`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import torch

from mstar import envs

logger = logging.getLogger(__name__)
T = TypeVar("T")


class _Switch:
    def __init__(self) -> None:
        self.enabled = envs.fused_kernels()
        self.norm_linear = envs.fuse_norm_linear()
        self.interpret = os.environ.get("TRITON_INTERPRET") == "1"
        self._ops: ModuleType | None | bool = False  # False: not imported yet; None: unavailable

    def ops_for(self, x: torch.Tensor) -> ModuleType | None:
        """The fused-ops module if it should handle `x`, else None (use PyTorch)."""
        if not self.enabled or not (x.is_cuda or self.interpret):
            return None
        if self._ops is False:
            try:
                from mstar.kernels import fused_ops

                self._ops = fused_ops
            except ImportError:  # no triton: the PyTorch path serves
                self._ops = None
        return self._ops  # type: ignore[return-value]


FUSED = _Switch()


class KernelGuard:
    """One newer Triton kernel on trial: `run` calls it while it works; if it ever fails to build or
    launch (a Triton or driver version that cannot compile it), the PyTorch form serves from then on
    (logged once) rather than every request failing. A failure inside a CUDA-graph capture is raised:
    a capture cannot switch paths mid-graph, and the eager warm-up before it has run the kernel."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.usable = True

    def run(self, kernel: Callable[[], T], fallback: Callable[[], T]) -> T:
        """kernel(), or fallback() once the kernel has failed."""
        if self.usable:
            try:
                return kernel()
            except Exception:
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                logger.exception("%s kernel failed; its PyTorch form serves from now on", self.name)
                self.usable = False
        return fallback()
