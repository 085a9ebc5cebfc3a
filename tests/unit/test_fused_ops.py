"""The fused Triton kernels equal the PyTorch layers (run on CPU through the Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


def test_fused_kernels_match_pytorch_layers():
    proc = run_interpreted(Path(__file__).with_name("fused_ops_check.py"), "--quick")  # one shape; all: below
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fused ops ok" in proc.stdout


@pytest.mark.slow  # runs a whole kernel check; CI's slow group runs it
def test_fused_kernels_match_pytorch_layers_all_shapes():
    proc = run_interpreted(Path(__file__).with_name("fused_ops_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fused ops ok" in proc.stdout
