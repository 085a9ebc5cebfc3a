"""The small-batch MoE path: its kernels equal the per-expert loop (CPU, Triton interpreter), SparseMoE
picks it for few slots, and a kernel that fails falls back to the other paths once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from mstar.layers import moe as moe_mod
from mstar.layers.fused import FUSED
from mstar.layers.moe import MoESpec, SparseMoE, moe_graph_capturable
from tests.interpreted import run_interpreted


def _moe() -> SparseMoE:
    torch.manual_seed(0)
    moe = SparseMoE(MoESpec(hidden_size=8, num_experts=4, top_k=2, intermediate_size=16))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_small_kernels_match_loop_interpreted():
    pytest.importorskip("triton")
    proc = run_interpreted(Path(__file__).with_name("moe_small_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "moe small ok" in proc.stdout


def test_small_kernels_match_loop_interpreted_one_shape():
    """The default run's representative of the check above (its whole run is in the slow group)."""
    pytest.importorskip("triton")
    proc = run_interpreted(Path(__file__).with_name("moe_small_check.py"), "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "moe small ok" in proc.stdout


def test_cpu_without_interpreter_takes_the_loop(monkeypatch):
    monkeypatch.setattr(FUSED, "interpret", False)
    assert moe_mod.pick_path(torch.zeros(1, 8), 2) == "loop"


def test_unknown_force_path_raises():
    moe = _moe()
    moe.force_path = "sorted"
    with pytest.raises(ValueError, match="'small', 'tiled', 'grouped', 'loop'"):
        moe(torch.zeros(1, 8))


def test_forced_small_is_graph_capturable():
    moe = _moe()
    moe.force_path = "small"
    assert moe_graph_capturable(torch.nn.Sequential(moe))


def test_failing_kernel_falls_back_once(monkeypatch, caplog):
    small = pytest.importorskip("mstar.kernels.moe_small")
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(small, "experts_small", broken)
    monkeypatch.setattr(FUSED, "interpret", True)  # the small path would serve CPU tensors
    monkeypatch.setattr(FUSED, "enabled", True)
    monkeypatch.setattr(moe_mod._SMALL, "usable", True)
    monkeypatch.setattr(moe_mod._TILED, "usable", False)  # the tiled path would come next
    monkeypatch.setattr(moe_mod, "ROUTE_MAX_EXPERTS", 0)  # route in PyTorch: this process has no interpreter
    moe, x = _moe(), torch.randn(3, 8)
    assert moe_mod.pick_path(x, 2) == "small"
    with torch.no_grad(), caplog.at_level(logging.ERROR, logger="mstar.layers.moe"):
        got = moe(x)
        moe(x)
        moe.force_path = "loop"
        want = moe(x)
    assert calls == [1], "a failed kernel is not tried again"
    assert moe_mod.pick_path(x, 2) == "loop"
    assert sum("small-batch MoE kernel failed" in r.message for r in caplog.records) == 1
    torch.testing.assert_close(got, want)
