"""FP8 routed experts in the MoE kernels: the interpreted check (tests/unit/moe_fp8_check.py) against the
per-expert loop over the dequantized experts, and SparseMoE's FP8 paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted


@pytest.mark.slow  # the bf16 MoE kernels' one-shape checks run by default; the FP8 variant of each here
def test_fp8_experts_match_loop_interpreted():
    pytest.importorskip("triton")
    proc = run_interpreted(Path(__file__).with_name("moe_fp8_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "moe fp8 ok" in proc.stdout
