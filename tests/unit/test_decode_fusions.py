"""The decode fusions (RoPE and split merge inside decode attention, RMSNorm folded into the skinny
GEMV) equal the kernels they replace (CPU, Triton interpreter; see decode_fusion_cases.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


def _run(which: str) -> str:
    proc = run_interpreted(Path(__file__).with_name("decode_fusion_cases.py"), which)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "decode fusions ok" in proc.stdout
    return proc.stdout


def test_rotary_and_split_merge_in_decode_attention():
    out = _run("attention")
    assert out.count(": ok") == 4, out  # GQA, padded groups of 3, MHA head_dim 24, bf16


def test_rms_norm_folded_into_gemv():
    out = _run("gemv")
    assert "norm gemv torch.bfloat16: ok" in out and "norm selection torch.float32: ok" in out, out
