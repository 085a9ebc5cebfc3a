"""The Wan DiT block kernels (mstar/models/wan22/wan_ops.py) equal the PyTorch forms of block_math.py, and
the tiny DiT with them on matches diffusers; the VAE's channel norm kernel (mstar/models/common/wan_vae/wan_vae_ops.py)
equals ChannelRMSNorm's PyTorch form, and the channels-last decode's kernels (wan_vae_cl_ops.py) theirs
(run on CPU through the Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")
pytest.importorskip("diffusers")


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_wan_kernels_match_the_torch_forms_and_diffusers():
    # A fresh process: triton reads TRITON_INTERPRET when the kernels are decorated.
    proc = run_interpreted(Path(__file__).with_name("wan22_kernels_check.py"), OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wan ops ok" in proc.stdout


def test_wan_kernels_match_the_torch_forms_one_shape():
    """The default run's representative of the three checks here (their whole runs are in the slow group):
    one float32 shape of each DiT block kernel, the VAE's channel norm and the channels-last VAE kernels."""
    proc = run_interpreted(Path(__file__).with_name("wan22_quick_check.py"), OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wan quick ok" in proc.stdout


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_wan_vae_norm_kernel_matches_the_torch_form():
    proc = run_interpreted(Path(__file__).with_name("wan22_vae_kernels_check.py"), OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wan vae ops ok" in proc.stdout


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_wan_vae_channels_last_kernels_match_the_torch_forms():
    """models/common/wan_vae/wan_vae_cl_ops.py (the channels-last decode's norm with a folded bias, residual add and
    space-time shortcut add) against their PyTorch forms, then a tiny channels-last decode through them."""
    proc = run_interpreted(Path(__file__).with_name("wan22_vae_cl_check.py"), OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wan vae channels-last ops ok" in proc.stdout
