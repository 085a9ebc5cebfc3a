"""Per-row head windows (`mstar.layers.logit_windows`): the reference mask, the Triton kernel under the
interpreter, and the windows' checks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mstar.layers.logit_windows import LogitWindows, masked_window_logits
from tests.interpreted import run_interpreted


def test_masked_window_logits_keeps_each_rows_window_and_the_always_columns():
    starts = torch.tensor([3, 0, 5], dtype=torch.int32)  # id -> window start
    windows = LogitWindows(starts, 2, always=(9,))
    logits = torch.arange(20, dtype=torch.float32).view(2, 10)
    got = masked_window_logits(logits.clone(), torch.tensor([2, 0]), windows)
    inf = -math.inf
    assert got.tolist() == [[inf, inf, inf, inf, inf, 5.0, 6.0, inf, inf, 9.0],
                            [inf, inf, inf, 13.0, 14.0, inf, inf, inf, inf, 19.0]]


def test_windows_that_do_not_fit_are_refused():
    good = LogitWindows(torch.tensor([0, 8], dtype=torch.int32), 2, always=(5,))
    good.check(10, 2)
    with pytest.raises(ValueError, match="do not fit"):
        LogitWindows(torch.tensor([0, 9], dtype=torch.int32), 2).check(10, 2)
    with pytest.raises(ValueError, match="outside"):
        LogitWindows(torch.tensor([0, 8], dtype=torch.int32), 2, always=(10,)).check(10, 2)
    with pytest.raises(ValueError, match="int32"):
        LogitWindows(torch.tensor([0, 8]), 2).check(10, 2)


def test_window_head_kernel_matches_the_masked_reference():
    pytest.importorskip("triton")
    proc = run_interpreted(Path(__file__).with_name("window_head_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "window head ok" in proc.stdout
