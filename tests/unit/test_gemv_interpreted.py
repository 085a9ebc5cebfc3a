"""The small-M GEMV and the fused SiLU-and-mul down projection equal PyTorch (CPU, Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_gemv_and_fused_silu_down_match_torch():
    proc = run_interpreted(Path(__file__).with_name("gemv_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gemv ok" in proc.stdout


def test_gemv_and_fused_silu_down_match_torch_one_shape():
    """The default run's representative of the check above (its whole run is in the slow group)."""
    proc = run_interpreted(Path(__file__).with_name("gemv_check.py"), "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gemv ok" in proc.stdout
