"""Every text decoder's default request ends: Qwen3-Omni's tiny flavour, whose random weights never sample
eos, bounds a default answer by a small context; the real model keeps the checkpoint's."""

from __future__ import annotations

from mstar.models.qwen3_omni.model import Qwen3Omni


def test_qwen3_omni_tiny_context_bounds_a_default_answer():
    assert Qwen3Omni.make_config(tiny=True).context == 2048
    assert Qwen3Omni.make_config().context == 32768
    assert Qwen3Omni.make_config(tiny=True, max_model_len=512).context == 512
