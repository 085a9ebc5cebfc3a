"""V-JEPA 2's fused kernels (RoPE; residual add + LayerNorm) equal their PyTorch forms, alone and inside the
tiny AC predictor, and a seeded search through them plans the eager actions (run on CPU through the Triton
interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


def test_vjepa2_kernels_match_the_torch_forms():
    proc = run_interpreted(Path(__file__).with_name("vjepa2_kernels_check.py"))  # float32; the rest: below
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vjepa2 kernels ok" in proc.stdout


@pytest.mark.slow  # each part runs a whole kernel check; CI's slow group runs them
@pytest.mark.parametrize("part", [("--dtype", "float16"), ("--dtype", "bfloat16"), ("--search",)], ids=["float16", "bfloat16", "search"])
def test_vjepa2_kernels_match_the_torch_forms_other_dtypes_and_plan(part):
    proc = run_interpreted(Path(__file__).with_name("vjepa2_kernels_check.py"), *part)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vjepa2 kernels ok" in proc.stdout
