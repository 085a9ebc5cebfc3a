"""Which tensors the fused Triton kernels (`mstar/kernels/fused_ops.py`) serve.

They run for CUDA tensors when triton imports (and for CPU tensors under TRITON_INTERPRET=1, for
tests); MSTAR_FUSED_KERNELS=0 turns them off (the PyTorch code in the layers is the reference).
The switch is read once per process; tests take their PyTorch reference under `fused_kernels(False)`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

from mstar import envs


class _Switch:
    def __init__(self) -> None:
        self.enabled = envs.fused_kernels()
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


@contextmanager
def fused_kernels(enabled: bool) -> Iterator[None]:
    """Inside the block `FUSED.enabled` is `enabled` (False: the layers run their PyTorch reference); on
    exit, also through an exception, it is what it was before."""
    previous, FUSED.enabled = FUSED.enabled, enabled
    try:
        yield
    finally:
        FUSED.enabled = previous
