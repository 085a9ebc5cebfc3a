"""The fused SNAC kernels (mstar/models/orpheus/snac_ops.py) equal the PyTorch form of Orpheus's vocoder, kernel by
kernel and for whole window decodes (run on CPU through the Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_snac_kernels_match_the_torch_form():
    # A fresh process: triton reads TRITON_INTERPRET when the kernels are decorated.
    proc = run_interpreted(Path(__file__).with_name("orpheus_snac_kernels_check.py"), OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "snac kernels ok" in proc.stdout


def test_snac_kernels_match_the_torch_form_one_shape():
    """The default run's representative of the check above (its whole run is in the slow group)."""
    proc = run_interpreted(Path(__file__).with_name("orpheus_snac_kernels_check.py"), "--quick", OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "snac kernels ok" in proc.stdout
