"""A CUDA worker steps its engines on a stream of the highest priority (MSTAR_PRIORITY_STREAM), above the
default priority of its side-stream engines, and an Orpheus request served that way equals one served on
the default stream.

Run on the lent machine: `python3 -m pytest -q -m gpu tests/gpu/test_priority_stream_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from mstar.worker.worker import main_stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_main_stream_outranks_side_streams(monkeypatch) -> None:
    stream = main_stream(torch.device("cuda"))
    side = torch.cuda.Stream(torch.device("cuda"))  # what stateless._side_stream makes
    assert stream is not None and stream.priority < side.priority  # lower number: higher priority
    monkeypatch.setenv("MSTAR_PRIORITY_STREAM", "0")
    assert main_stream(torch.device("cuda")) is None


def test_orpheus_audio_is_the_same_on_the_priority_stream(monkeypatch) -> None:
    """Tiny Orpheus on CUDA, greedy: the same audio whether the worker steps on the priority stream or
    on the default one (the vocoder's side stream waits for the LM's tokens either way)."""
    import numpy as np

    from mstar.runtime.offline import MStar

    config = {"model": "orpheus", "device": "cuda"}

    def speak() -> np.ndarray:
        with MStar("orpheus", config=config, tiny=True) as m:
            result = m.generate({"text": "Hello from the GPU."}, max_tokens=70, seed=0, temperature=0.0)
        return np.concatenate(result.outputs["audio"])

    on = speak()
    monkeypatch.setenv("MSTAR_PRIORITY_STREAM", "0")
    off = speak()
    assert on.size > 0 and np.array_equal(on, off)
