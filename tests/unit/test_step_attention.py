"""The one-step attention kernel equals the code predictor's PyTorch step (run on CPU through the Triton
interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


def test_step_attention_matches_the_pytorch_step():
    proc = run_interpreted(Path(__file__).with_name("step_attention_check.py"), "--quick")  # one shape; all: below
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step attention ok" in proc.stdout


@pytest.mark.slow  # runs a whole kernel check; CI's slow group runs it
def test_step_attention_matches_the_pytorch_step_all_shapes():
    proc = run_interpreted(Path(__file__).with_name("step_attention_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step attention ok" in proc.stdout
