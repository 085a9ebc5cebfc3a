"""V-JEPA 2's fused kernels (RoPE; residual add + LayerNorm) equal their PyTorch forms, alone and inside the
tiny AC predictor, and a seeded search through them plans the eager actions (run on CPU through the Triton
interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


def test_vjepa2_kernels_match_the_torch_forms():
    proc = run_interpreted(Path(__file__).with_name("vjepa2_kernels_check.py"), "--quick")  # float32; all: below
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vjepa2 kernels ok" in proc.stdout


@pytest.mark.slow  # runs a whole kernel check; CI's slow group runs it
def test_vjepa2_kernels_match_the_torch_forms_all_dtypes_and_plan():
    proc = run_interpreted(Path(__file__).with_name("vjepa2_kernels_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vjepa2 kernels ok" in proc.stdout
