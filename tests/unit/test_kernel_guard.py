"""KernelGuard: a kernel that fails once is logged once and replaced by the PyTorch form for good; running
out of device memory is raised, not taken for a broken kernel."""

from __future__ import annotations

import logging

import pytest
import torch

from mstar.kernels.guard import KernelGuard


def test_failing_kernel_falls_back_for_good(caplog):
    guard, calls = KernelGuard("broken"), []

    def kernel():
        calls.append("kernel")
        raise RuntimeError("cannot compile")

    with caplog.at_level(logging.ERROR, logger="mstar.layers.fused"):
        assert guard.run(kernel, lambda: "reference") == "reference"
        assert guard.run(kernel, lambda: "reference") == "reference"
    assert calls == ["kernel"] and not guard.usable
    assert sum("broken" in r.getMessage() for r in caplog.records) == 1


def test_working_kernel_serves():
    guard = KernelGuard("fine")
    assert guard.run(lambda: 1, lambda: 2) == 1 and guard.usable


def test_out_of_memory_is_raised_and_the_kernel_kept():
    guard = KernelGuard("big")

    def kernel():
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        guard.run(kernel, lambda: "reference")
    assert guard.usable
