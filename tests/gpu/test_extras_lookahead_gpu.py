"""A spoken answer's thinker steps (hidden states captured for the talker) launch ahead through the
extras graph (`lookahead.py`, `ExtrasGraphs.ahead_inputs`), with the thinker on a stream of its own
(`engines/own_stream.py`): tiny Qwen3-Omni on CUDA, float32, several requests in flight, serves the
same text and audio as without lookahead on one stream, and the thinker's lookahead forwards are used.

Run on the lent machine: `python3 -m pytest -q -m gpu tests/gpu/test_extras_lookahead_gpu.py`.
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
SPOKEN = {"temperature": 0.0, "max_tokens": 12, "modalities": ["text", "audio"], "voice": "Aiden",
          "talker.temperature": 0.0, "talker.max_tokens": 16}


def _serve(fast: bool) -> tuple[list[tuple[str, np.ndarray]], int]:
    config = {"model": "qwen3_omni", "device": "cuda", "cuda_graphs": {"lookahead": fast},
              "model_kwargs": {"code2wav_chunk": 4, "dtype": "float32", "thinker_stream": fast}}
    with MStar("qwen3_omni", config=config, tiny=True) as m:
        thinker = m.runtime.workers[0].engines["thinker"]
        assert isinstance(thinker, OwnStreamEngine) == fast
        handles = [m.submit(chat, **SPOKEN) for chat in CHATS]  # in flight together
        results = [h.decoded() for h in handles]
        hits = thinker.lookahead_hits
    return [("".join(r.outputs["text"]), np.concatenate(r.outputs["audio"])) for r in results], hits


def test_spoken_thinker_steps_launch_ahead_and_change_nothing() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    (want, _), (got, hits) = _serve(False), _serve(True)
    assert hits > 10  # the thinker's spoken-answer steps used forwards launched ahead
    for (text_w, audio_w), (text_g, audio_g) in zip(want, got, strict=True):
        assert text_g == text_w and text_w
        assert audio_g.shape == audio_w.shape and audio_w.size > 0
        np.testing.assert_allclose(audio_g, audio_w, atol=1e-5)
