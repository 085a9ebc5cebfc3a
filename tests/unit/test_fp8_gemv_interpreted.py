"""The FP8-weight GEMV and its tl.dot kernel equal the dequantize-then-linear references (CPU, Triton
interpreter): per-channel and block scales, ragged shapes, bias, explicit and picked configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


@pytest.mark.slow  # runs a whole kernel check; CI's slow group runs it
def test_fp8_gemv_matches_the_references():
    proc = run_interpreted(Path(__file__).with_name("fp8_gemv_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fp8 gemv ok" in proc.stdout


def test_fp8_gemv_matches_the_references_few_shapes():
    """The default run's representative of the check above (its whole run is in the slow group)."""
    proc = run_interpreted(Path(__file__).with_name("fp8_gemv_check.py"), "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fp8 gemv ok" in proc.stdout
