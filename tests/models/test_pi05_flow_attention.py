"""Pi0.5's flow attention over the valid keys only (mstar/models/pi05/flow_attention.py) equals the masked form,
kernel alone and as the tiny policy's chunks (run on CPU through the Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")
CHECK = Path(__file__).with_name("pi05_flow_attention_check.py")


@pytest.mark.slow  # every kernel case; CI's slow group runs it
def test_flow_attention_matches_the_masked_form():
    proc = run_interpreted(CHECK, OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "flow attention ok" in proc.stdout


def test_flow_attention_matches_the_masked_form_one_shape():
    """The default run's representative of the check above: one kernel case and the policy's chunks."""
    proc = run_interpreted(CHECK, "--quick", OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "flow attention ok" in proc.stdout
