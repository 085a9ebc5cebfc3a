"""A spoken chat about an image and an audio clip (--tiny, CPU) gives the same text and audio on one worker
and on two worker processes placed as mstar/configs/qwen3_omni_2gpu.yaml (encoders + thinker on rank 0)."""

import dataclasses

import numpy as np
import pytest

from mstar.config import load_config
from mstar.runtime.offline import MStar
from tests.models.qwen3_omni_testing import media_chat_request

KWARGS = {"code2wav_chunk": 4}
OPTIONS = dict(temperature=0.0, max_tokens=6, modalities=["text", "audio"],
               **{"talker.temperature": 0.0, "talker.max_tokens": 8})




@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow  # test_qwen3_omni_runtime.py runs the same placement over two processes by default
def test_one_worker_and_two_processes_agree_on_a_media_chat():
    config = {"model": "qwen3_omni", "device": "cpu", "model_kwargs": KWARGS}
    with MStar("qwen3_omni", config=config, tiny=True) as one:
        want = one.generate(media_chat_request(), **OPTIONS)
    cfg = dataclasses.replace(load_config("qwen3_omni_2gpu"), device="cpu",
                              model_kwargs=KWARGS)
    with MStar("qwen3_omni", config=cfg, mode="multiproc", tiny=True) as two:
        got = two.generate(media_chat_request(), **OPTIONS)
    assert "".join(want.outputs["text"]) and got.outputs["text"] == want.outputs["text"]
    want_audio, got_audio = np.concatenate(want.outputs["audio"]), np.concatenate(got.outputs["audio"])
    assert want_audio.size > 0
    np.testing.assert_allclose(got_audio, want_audio, atol=1e-6)
