"""The toy's media inputs (folded into the prompt as statistic bytes) and its progress output."""

import numpy as np
import pytest

from mstar.models.toy.model import ToyConfig
from mstar.models.toy.processor import ToyProcessor, media_summary
from mstar.runtime.offline import MStar


def test_media_summary_bytes():
    image = np.zeros((4, 300, 3), np.uint8)
    image[..., 0] = 200
    assert media_summary({"type": "image", "data": image}) == [200, 0, 0, 4, 300 % 256]
    audio = np.concatenate([np.zeros(8), np.ones(8)]).astype(np.float32)
    assert media_summary({"type": "audio", "data": audio}) == [0, 0, 0, 0, 255, 255, 255, 255]
    video = np.full((3, 2, 2, 3), 9, np.uint8)
    assert media_summary({"type": "video", "data": video}) == [3, 9, 9, 9]
    with pytest.raises(ValueError, match="image, audio and video"):
        media_summary({"type": "tensor", "data": np.zeros(2)})
    with pytest.raises(ValueError, match=r"\(H, W, 3\)"):
        media_summary({"type": "image", "data": np.zeros((4, 4))})


def test_prompt_is_text_then_media_and_needs_one_of_them():
    proc = ToyProcessor(ToyConfig())
    video = np.full((2, 2, 2, 3), 7, np.uint8)
    ids = proc.inputs({"text": "hi", "media": [{"type": "video", "data": video}]}, {})["prompt_ids"]
    assert ids.tolist() == [ord("h"), ord("i"), 2, 7, 7, 7]
    assert proc.inputs({"media": [{"type": "video", "data": video}]}, {})["prompt_ids"].tolist() == [2, 7, 7, 7]
    with pytest.raises(ValueError, match="media input"):
        proc.inputs({"text": ""}, {})


def _text(result) -> str:
    return "".join(bytes(t.tolist()).decode("latin-1") for t in result.outputs["text"])


def test_media_change_the_answer_and_progress_is_reported_per_token():
    audio = {"type": "audio", "data": (np.sin(np.arange(4000) / 50.0) * 0.9).astype(np.float32),
             "sample_rate": 8000}
    with MStar("toy", mode="inproc") as m:
        plain = m.submit({"text": "hi"}, max_tokens=5, stop_early=False).result()
        heard = m.submit({"text": "hi", "media": [audio]}, max_tokens=5, stop_early=False).result()
        again = m.submit({"text": "hi", "media": [audio]}, max_tokens=5, stop_early=False,
                         report_progress=True).result()
    assert _text(heard) != _text(plain) and _text(again) == _text(heard)
    assert "progress" not in plain.outputs  # only when asked: plain requests are unchanged
    assert [float(p[0]) for p in again.outputs["progress"]] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
