"""Served Qwen3-Omni at tiny size (Qwen tokenizer, random weights): in-process on one worker and
multi-process over two CPU workers (mstar/configs/qwen3_omni_2gpu.yaml) give the same text and audio."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mstar.config import load_config
from mstar.runtime.offline import MStar

CHAT = {"messages": [{"role": "user", "content": "Say hello to the assistant."}]}
KWARGS = {"code2wav_chunk": 4}  # several audio chunks from a short answer
SPOKEN = {"temperature": 0.0, "max_tokens": 6, "modalities": ["text", "audio"], "voice": "Aiden",
          "talker.temperature": 0.0, "talker.max_tokens": 12}


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def _run(mstar: MStar) -> tuple[str, np.ndarray, str, list[int]]:
    spoken = mstar.generate(CHAT, **SPOKEN)
    text = mstar.generate(CHAT, temperature=0.0, max_tokens=6)
    audio = spoken.outputs["audio"]
    return "".join(spoken.outputs["text"]), np.concatenate(audio), "".join(text.outputs["text"]), \
        [len(a) for a in audio]


@pytest.mark.slow  # the Omni walk across processes; one process: the Omni server tests, two: the thinker-TP runtime
def test_one_worker_and_two_processes_agree():
    with MStar("qwen3_omni", config={"model": "qwen3_omni", "device": "cpu", "model_kwargs": KWARGS}, tiny=True) as one:
        want = _run(one)
        with pytest.raises(ValueError, match="voices are"):
            one.submit(CHAT, voice="Bob")
    spoken_text, audio, text, pieces = want
    assert text and spoken_text == text  # speaking changes nothing in the thinker's greedy text
    assert audio.dtype == np.float32 and len(pieces) > 1, "audio should stream in several chunks"
    cfg = dataclasses.replace(load_config("qwen3_omni_2gpu"), device="cpu",
                              model_kwargs=KWARGS)
    with MStar("qwen3_omni", config=cfg, mode="multiproc", tiny=True) as two:
        got = _run(two)
    assert got[0] == want[0] and got[2] == want[2] and got[3] == want[3]
    np.testing.assert_allclose(got[1], want[1], atol=1e-6)
