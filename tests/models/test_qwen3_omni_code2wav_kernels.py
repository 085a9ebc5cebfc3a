"""Code2Wav's fused SnakeBeta kernel (mstar/kernels/snake.py) equals the PyTorch form, alone and inside the
tiny Code2Wav (run on CPU through the Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


def test_snake_kernel_matches_the_torch_form():
    # A fresh process: triton reads TRITON_INTERPRET when the kernels are decorated.
    proc = run_interpreted(Path(__file__).with_name("qwen3_omni_snake_check.py"), OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "snake ok" in proc.stdout
