"""The fused MoE route kernel equals the PyTorch route (run on CPU through the Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


def test_route_kernel_matches_pytorch_route():
    proc = run_interpreted(Path(__file__).with_name("moe_route_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "moe route ok" in proc.stdout
