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


def _serve(folder, config, mode: str) -> tuple[list[list[int]], torch.Tensor]:
    with MStar("qwen3_omni", config=config, model_path=str(folder), mode=mode) as mstar:
        text, _ = outputs(submit_ids(mstar, PROMPT, temperature=0.0, max_tokens=8, ignore_eos=True))
        spoken_text, audio = outputs(submit_ids(mstar, PROMPT, **SPOKEN))
    return [text, spoken_text], audio


@pytest.fixture(scope="module")
def whole(tmp_path_factory, one_thread):
    """(checkpoint folder, texts, audio) of the whole thinker on one worker, in this process."""
    folder = tmp_path_factory.mktemp("qwen3_omni_tp")
    make_reference(folder)
    texts, audio = _serve(folder, {**runtime_config(dtype="float32"), "device": "cpu"}, "inproc")
    assert len(texts[0]) == 8 and texts[0] == texts[1]  # speaking changes no thinker token
    assert audio.numel() > 0
    return folder, texts, audio


# model_kwargs.thinker_tp_attention; the experts-only split is also checked layer by layer by
# test_qwen3_omni_thinker_tp.py, so its two-process run is in the slow group
@pytest.mark.parametrize("split_attention", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_tensor_parallel_thinker_serves_the_same_answers(whole, split_attention):
    folder, want_texts, want_audio = whole
    layout = load_config("qwen3_omni_2gpu_tp").node_groups
    two = {**runtime_config(dtype="float32", thinker_tp_attention=split_attention), "device": "cpu",
           "node_groups": [dataclasses.asdict(group) for group in layout]}
    assert two["node_groups"][0]["tp_size"] == 2
    got_texts, got_audio = _serve(folder, two, "multiproc")
    assert got_texts == want_texts
    assert got_audio.shape == want_audio.shape
    torch.testing.assert_close(got_audio, want_audio, rtol=0, atol=1e-4)
