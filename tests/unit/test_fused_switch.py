"""fused_kernels: sets FUSED.enabled for a block and gives back the value it found, also when the block raises."""

from __future__ import annotations

import pytest
import torch

from mstar.layers.fused import FUSED, fused_kernels


@pytest.mark.parametrize("before", [True, False])
def test_restores_the_previous_value(monkeypatch, before):
    monkeypatch.setattr(FUSED, "enabled", before)
    for inside in (True, False):
        with fused_kernels(inside):
            assert FUSED.enabled is inside
        assert FUSED.enabled is before


def test_restores_when_the_block_raises(monkeypatch):
    monkeypatch.setattr(FUSED, "enabled", True)
    with pytest.raises(RuntimeError, match="boom"), fused_kernels(False):
        assert FUSED.enabled is False
        raise RuntimeError("boom")
    assert FUSED.enabled is True


def test_off_means_pytorch_even_where_the_kernels_would_serve(monkeypatch):
    monkeypatch.setattr(FUSED, "enabled", True)
    monkeypatch.setattr(FUSED, "interpret", True)  # the kernels would serve CPU tensors (where triton imports)
    with fused_kernels(False):
        assert FUSED.ops_for(torch.zeros(1)) is None
