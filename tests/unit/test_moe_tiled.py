"""The tiled MoE path: its kernels equal the per-expert loop, alone and split over expert-parallel ranks, and
SparseMoE picks it between the small path's range and the grouped path's (CPU, Triton interpreter), unless
MSTAR_MOE_TILED=0."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_tiled_kernels_match_loop_interpreted():
    pytest.importorskip("triton")
    proc = run_interpreted(Path(__file__).with_name("moe_tiled_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "moe tiled ok" in proc.stdout


def test_tiled_kernels_match_loop_interpreted_one_shape():
    """The default run's representative of the check above (its whole run is in the slow group)."""
    pytest.importorskip("triton")
    proc = run_interpreted(Path(__file__).with_name("moe_tiled_check.py"), "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "moe tiled ok" in proc.stdout


@pytest.mark.parametrize("value, usable", [("0", "False"), ("1", "True"), (None, "True")])
def test_env_switch_keeps_the_tiled_path_off(monkeypatch, value, usable):
    monkeypatch.delenv("MSTAR_MOE_TILED", raising=False)
    switch = {} if value is None else {"MSTAR_MOE_TILED": value}
    proc = run_interpreted(Path(__file__).with_name("moe_tiled_switch_check.py"), timeout=120, **switch)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == usable
