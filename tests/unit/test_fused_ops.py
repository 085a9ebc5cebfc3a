"""The fused Triton kernels equal the PyTorch layers (run on CPU through the Triton interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_fused_kernels_match_pytorch_layers():
    script = Path(__file__).with_name("fused_ops_check.py")
    root = Path(__file__).parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240,
                          cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fused ops ok" in proc.stdout
