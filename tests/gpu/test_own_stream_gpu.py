"""Qwen3-Omni's thinker on a CUDA stream of its own (engines/own_stream.py, `thinker_stream`, on by
default) serves the same text and audio as with every engine on the worker's stream, for spoken and
text answers of several requests in flight at once.

Run on the lent machine: `python3 -m pytest -q -m gpu tests/gpu/test_own_stream_gpu.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.engines.own_stream import OwnStreamEngine
from mstar.runtime.offline import MStar

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CHATS = [{"messages": [{"role": "user", "content": f"Say hello to assistant number {i}."}]} for i in range(3)]
SPOKEN = {"temperature": 0.0, "max_tokens": 8, "modalities": ["text", "audio"], "voice": "Aiden",
          "talker.temperature": 0.0, "talker.max_tokens": 16}


def _serve(thinker_stream: bool) -> list[tuple[str, np.ndarray]]:
    config = {"model": "qwen3_omni", "device": "cuda",
              "model_kwargs": {"code2wav_chunk": 4, "dtype": "float32", "thinker_stream": thinker_stream}}
    with MStar("qwen3_omni", config=config, tiny=True) as m:
        worker = m.runtime.workers[0]
        assert isinstance(worker.engines["thinker"], OwnStreamEngine) == thinker_stream
        handles = [m.submit(chat, **SPOKEN) for chat in CHATS]  # in flight together
        handles.append(m.submit(CHATS[0], temperature=0.0, max_tokens=8))  # a text answer beside them
        out = []
        for handle in handles:
            result = handle.result()
            audio = result.outputs.get("audio") or [np.zeros(0, np.float32)]
            out.append(("".join(result.outputs["text"]), np.concatenate(audio)))
    return out


def test_thinker_on_its_own_stream_serves_the_same_answers() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    want, got = _serve(False), _serve(True)
    for (text_w, audio_w), (text_g, audio_g) in zip(want, got, strict=True):
        assert text_g == text_w and text_w
        assert audio_g.shape == audio_w.shape
        np.testing.assert_allclose(audio_g, audio_w, atol=1e-5)
    assert got[0][1].size > 0
