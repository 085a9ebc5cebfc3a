"""`KernelGuard`: a newer Triton kernel beside its PyTorch form, so that a kernel that cannot build or
launch costs one logged failure, not failed requests. Imports no triton: layers, models and engines
import it at import time."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")


class KernelGuard:
    """One newer Triton kernel on trial: `run` calls it while it works; if it ever fails to build or
    launch (a Triton or driver version that cannot compile it), the PyTorch form serves from then on
    (logged once) rather than every request failing. A failure inside a CUDA-graph capture is raised:
    a capture cannot switch paths mid-graph, and the eager warm-up before it has run the kernel. Running out
    of device memory is raised too, and the kernel stays in use."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.usable = True

    def run(self, kernel: Callable[[], T], fallback: Callable[[], T]) -> T:
        """kernel(), or fallback() once the kernel has failed."""
        if self.usable:
            try:
                return kernel()
            except torch.OutOfMemoryError:  # a full device, not a broken kernel: the PyTorch form would fail too
                raise
            except Exception:
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                logger.exception("%s kernel failed; its PyTorch form serves from now on", self.name)
                self.usable = False
        return fallback()
