"""The per-token FP8 activation quantization kernel gives `quantize_per_channel`'s bits, and W8A8's
`scaled_mm` runs it instead of the PyTorch formula's float32 passes (CPU, Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


def test_fp8_activation_quantization_matches_the_formula():
    proc = run_interpreted(Path(__file__).with_name("fp8_quant_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fp8 quant ok" in proc.stdout
