"""The small-M GEMV and the fused SiLU-and-mul down projection equal PyTorch (CPU, Triton interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_gemv_and_fused_silu_down_match_torch():
    script = Path(__file__).with_name("gemv_check.py")
    root = Path(__file__).parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("MSTAR_SKINNY_GEMM", None)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240,
                          cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gemv ok" in proc.stdout
