"""The decode fusions (RoPE and split merge inside decode attention, RMSNorm folded into the skinny
GEMV) equal the kernels they replace (CPU, Triton interpreter; see decode_fusion_cases.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def _run(which: str) -> str:
    script = Path(__file__).with_name("decode_fusion_cases.py")
    root = Path(__file__).parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for name in ("MSTAR_SKINNY_GEMM", "MSTAR_FUSE_NORM_LINEAR", "MSTAR_FUSE_ROPE_ATTENTION", "MSTAR_FUSE_ATTENTION_REDUCE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(script), which], env=env, capture_output=True, text=True, timeout=240,
                          cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "decode fusions ok" in proc.stdout
    return proc.stdout


def test_rotary_and_split_merge_in_decode_attention():
    out = _run("attention")
    assert out.count(": ok") == 4, out  # GQA, padded groups of 3, MHA head_dim 24, bf16


def test_rms_norm_folded_into_gemv():
    out = _run("gemv")
    assert "norm gemv torch.bfloat16: ok" in out and "norm selection torch.float32: ok" in out, out
