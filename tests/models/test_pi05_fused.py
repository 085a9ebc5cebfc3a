"""Pi0.5's fused norms (a residual add with the next Gemma or adaRMS norm), GELU-and-mul and q and k rotated in one
launch equal their PyTorch forms, layer by layer and as the tiny policy's prefix and chunks (run on CPU through
the Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")
CHECK = Path(__file__).with_name("pi05_fused_check.py")


def test_fused_pi05_ops_match_the_pytorch_forms_float32():
    proc = run_interpreted(CHECK, "--quick", OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pi05 fused ok" in proc.stdout


@pytest.mark.slow  # bf16 as well; CI's slow group runs it
def test_fused_pi05_ops_match_the_pytorch_forms_float32_and_bf16():
    proc = run_interpreted(CHECK, OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pi05 fused ok" in proc.stdout


def test_a_norm_kernel_that_fails_hands_over_to_the_pytorch_form(monkeypatch, caplog):
    """A Triton that cannot build or launch the norm kernel costs one logged failure: the layers give the
    PyTorch form, and the kernel is not tried again."""
    import torch

    import mstar.models.pi05.norm_kernel as norm_kernel
    from mstar.kernels.guard import KernelGuard
    from mstar.layers.fused import FUSED, fused_kernels
    from mstar.models.pi05 import gemma

    monkeypatch.setattr(FUSED, "interpret", True)  # the fused path is taken for these CPU tensors
    monkeypatch.setattr(gemma, "_NORM", KernelGuard("Pi0.5 norm"))
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(norm_kernel, "modulated_rms_norm", broken)
    norm = gemma.AdaRMSNorm(32, 32, 1e-6).eval()
    gen = torch.Generator().manual_seed(5)
    x, branch = torch.randn(2, 5, 32, generator=gen), torch.randn(2, 5, 32, generator=gen)
    with torch.no_grad():
        modulation = norm.modulation(torch.randn(2, 32, generator=gen))
        got = [norm.add_modulate(x, branch, modulation[2], modulation) for _ in range(2)]
        with fused_kernels(False):
            want = norm.add_modulate(x, branch, modulation[2], modulation)
    assert all(torch.equal(g, w) for attempt in got for g, w in zip(attempt, want, strict=True))
    assert len(calls) == 1 and "Pi0.5 norm kernel failed" in caplog.text
