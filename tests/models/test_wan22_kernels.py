"""The Wan DiT block kernels (mstar/kernels/wan_ops.py) equal the PyTorch forms of block_math.py, and
the tiny DiT with them on matches diffusers (run on CPU through the Triton interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("diffusers")


def test_wan_kernels_match_the_torch_forms_and_diffusers():
    # A fresh process: triton reads TRITON_INTERPRET when the kernels are decorated.
    script = Path(__file__).with_name("wan22_kernels_check.py")
    root = Path(__file__).parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240,
                          cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wan ops ok" in proc.stdout
