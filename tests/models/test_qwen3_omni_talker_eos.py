"""A talker that says its EOS code (tiny Qwen3-Omni on CPU), first or mid-answer: the talk stops there,
or, with `talker.ignore_eos`, goes on fed the EOS code's embedding, and the EOS step makes no frame
either way. Before, a talk kept going past an EOS first code failed its next step (talker_input found
no `codec_embed_sum`; seen on the H200), and past a later one it was fed the previous frame's sum again."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

from mstar.models.qwen3_omni.components import CodecTalker, FrameCodePredictor
from mstar.runtime.offline import MStar

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

CHAT = {"messages": [{"role": "user", "content": "Say hello to the assistant."}]}
SPOKEN = {"temperature": 0.0, "max_tokens": 6, "modalities": ["text", "audio"], "voice": "Aiden",
          "talker.temperature": 0.0, "talker.max_tokens": 8}


@pytest.fixture(scope="module")
def omni():
    """One tiny runtime for every answer here: the patches below act per call, the model is built once."""
    config = {"model": "qwen3_omni", "device": "cpu", "model_kwargs": {"code2wav_chunk": 4}}
    with MStar("qwen3_omni", config=config, tiny=True) as m:
        yield m


def _speak(m: MStar, eos_step: int | None, **options) -> tuple[str, int, int]:
    """(text, audio samples, frames the code predictor made) of one spoken answer whose talker says EOS at
    step `eos_step` (0: its prompt step's code) when given."""
    real_logits, real_predict = CodecTalker.compute_logits, FrameCodePredictor.run_batch
    calls, frames = [], []

    def logits(self, hidden, input_ids=None):
        out = real_logits(self, hidden, input_ids)
        calls.append(1)
        if eos_step is not None and len(calls) == eos_step + 1:
            out = out.clone()
            out[:, self.talker.config.codec_ids["eos"]] = 1e4
        return out

    def predict(self, walk, node, inputs, options):
        outputs = real_predict(self, walk, node, inputs, options)
        frames.extend(1 for out in outputs if "codes" in out)
        return outputs

    with mock.patch.object(CodecTalker, "compute_logits", logits), \
            mock.patch.object(FrameCodePredictor, "run_batch", predict):
        result = m.generate(CHAT, **SPOKEN, **options)
    audio = result.outputs.get("audio") or [np.zeros(0, np.float32)]
    return "".join(result.outputs["text"]), int(np.concatenate(audio).size), len(frames)


@pytest.fixture(scope="module")
def plain(omni) -> tuple[str, int, int]:
    """The answer with no EOS said: talker.max_tokens - 1 frames, as transformers' generate speaks."""
    text, samples, frames = _speak(omni, None)
    assert text and samples > 0 and frames == SPOKEN["talker.max_tokens"] - 1
    return text, samples, frames


@pytest.mark.parametrize("eos_step", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_eos_stops_the_talk_or_is_skipped_under_ignore_eos(omni, plain, eos_step):
    steps = SPOKEN["talker.max_tokens"]
    text, samples, _ = plain
    stopped_text, stopped, stopped_frames = _speak(omni, eos_step)
    assert stopped_text == text and stopped_frames == eos_step and stopped < samples  # the frames before EOS
    kept_text, kept, kept_frames = _speak(omni, eos_step, **{"talker.ignore_eos": True})
    assert kept_text == text and kept_frames == steps - 2 and stopped < kept  # every frame but the EOS step's
