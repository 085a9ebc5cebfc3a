"""The fused small-vocabulary sampler equals the code predictor's PyTorch sampler (Triton interpreter on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_small_vocab_sampler_matches_pytorch():
    proc = run_interpreted(Path(__file__).with_name("small_vocab_sampling_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "small vocab sampling ok" in proc.stdout


def test_small_vocab_sampler_matches_pytorch_one_shape():
    """The default run's representative of the check above (its whole run is in the slow group)."""
    proc = run_interpreted(Path(__file__).with_name("small_vocab_sampling_check.py"), "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "small vocab sampling ok" in proc.stdout
