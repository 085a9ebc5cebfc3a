"""Qwen3-Omni served with its thinker tensor-parallel over two CPU worker processes (gloo; heads and
experts split, the engines in lockstep: worker/replica.py), the encoders with its lead and the talk
loop with its follower, as mstar/configs/qwen3_omni_2gpu_tp.yaml places them: from the tiny reference
checkpoint, the same greedy text and spoken answer as the whole thinker on one worker."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mstar.config import load_config
from mstar.runtime.offline import MStar
from tests.models.qwen3_omni_model_testing import PROMPT, make_reference, outputs, runtime_config, submit_ids

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
SPOKEN = {"modalities": ["text", "audio"], "temperature": 0.0, "max_tokens": 8, "ignore_eos": True,
          "talker.temperature": 0.0, "talker.max_tokens": 10}


def _serve(folder, config) -> tuple[list[list[int]], torch.Tensor]:
    with MStar("qwen3_omni", config=config, model_path=str(folder), mode="multiproc") as mstar:
        text, _ = outputs(submit_ids(mstar, PROMPT, temperature=0.0, max_tokens=8, ignore_eos=True))
        spoken_text, audio = outputs(submit_ids(mstar, PROMPT, **SPOKEN))
    return [text, spoken_text], audio


@pytest.mark.parametrize("split_attention", [True, False])  # model_kwargs.thinker_tp_attention
def test_tensor_parallel_thinker_serves_the_same_answers(tmp_path, split_attention):
    make_reference(tmp_path)
    one = {**runtime_config(dtype="float32"), "device": "cpu"}
    layout = load_config("qwen3_omni_2gpu_tp").node_groups
    two = {**runtime_config(dtype="float32", thinker_tp_attention=split_attention), "device": "cpu",
           "node_groups": [dataclasses.asdict(group) for group in layout]}
    assert two["node_groups"][0]["tp_size"] == 2
    want_texts, want_audio = _serve(tmp_path, one)
    got_texts, got_audio = _serve(tmp_path, two)
    assert len(want_texts[0]) == 8 and want_texts[0] == want_texts[1]  # speaking changes no thinker token
    assert got_texts == want_texts
    assert want_audio.numel() > 0 and got_audio.shape == want_audio.shape
    torch.testing.assert_close(got_audio, want_audio, rtol=0, atol=1e-4)
