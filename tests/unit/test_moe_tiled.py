"""The tiled MoE path: its kernels equal the per-expert loop, alone and split over expert-parallel ranks, and
SparseMoE picks it between the small path's range and the grouped path's (CPU, Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted


def test_tiled_kernels_match_loop_interpreted():
    pytest.importorskip("triton")
    proc = run_interpreted(Path(__file__).with_name("moe_tiled_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "moe tiled ok" in proc.stdout
