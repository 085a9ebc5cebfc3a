"""The skinny-GEMM Triton kernel equals F.linear (run on CPU through the Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


def test_skinny_gemm_matches_f_linear():
    proc = run_interpreted(Path(__file__).with_name("skinny_gemm_check.py"), "--quick")  # one shape; all: below
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "skinny gemm ok" in proc.stdout


@pytest.mark.slow  # runs a whole kernel check; CI's slow group runs it
def test_skinny_gemm_matches_f_linear_all_shapes():
    proc = run_interpreted(Path(__file__).with_name("skinny_gemm_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "skinny gemm ok" in proc.stdout
