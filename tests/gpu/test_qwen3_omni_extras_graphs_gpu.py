"""Qwen3-Omni decode steps with extras (thinker hidden capture, talker input embeddings, 3-row positions)
replayed from CUDA graphs (engines/autoregressive/extras_graph.py): a spoken answer in bf16 is the same
with decode graphs as without, and the graphs are actually used."""

from __future__ import annotations

import pytest
import torch

from mstar.engines.own_stream import OwnStreamEngine
from mstar.runtime.offline import MStar
from tests.models.qwen3_omni_model_testing import PROMPT, make_reference, outputs, runtime_config, submit_ids

pytest.importorskip("transformers")


class _Counted:
    """A graph set whose replays (calls) are counted into `counts[name]`; anything else passes through."""

    def __init__(self, graphs, counts: dict, name: str) -> None:
        self._graphs, self._counts, self._name = graphs, counts, name

    def __call__(self, *args, **kwargs):
        self._counts[self._name] += 1
        return self._graphs(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._graphs, name)


def _speak(tmp_path, graphs: bool):
    config = runtime_config(dtype="bfloat16")
    config["device"] = "cuda"
    config["cuda_graphs"] = {"enabled": graphs, "max_batch_size": 8}
    with MStar("qwen3_omni", config=config, model_path=str(tmp_path)) as mstar:  # in-process workers
        engines = mstar.runtime.workers[0].engines
        replays = {"thinker": 0, "talker": 0}
        for name in replays if graphs else ():
            engine = engines[name]
            engine = engine.engine if isinstance(engine, OwnStreamEngine) else engine  # the thinker's own stream
            extras = engine.runner.extras_graphs
            assert extras is not None and extras.graphs is not None
            extras.graphs = _Counted(extras.graphs, replays, name)  # replays in step and launched ahead
        handle = submit_ids(mstar, PROMPT, modalities=["text", "audio"], temperature=0, max_tokens=12,
                            ignore_eos=True, **{"talker.temperature": 0.0, "talker.max_tokens": 16})
        text, audio = outputs(handle)
    return text, audio, replays


def test_spoken_answer_same_with_and_without_decode_graphs(tmp_path):
    make_reference(tmp_path)
    text_g, audio_g, replays = _speak(tmp_path, graphs=True)
    text_e, audio_e, _ = _speak(tmp_path, graphs=False)
    assert len(text_g) == 12 and audio_g.numel() > 0
    assert text_g == text_e
    assert audio_g.shape == audio_e.shape
    torch.testing.assert_close(audio_g.float(), audio_e.float(), rtol=0, atol=2e-2)
    # the thinker's decode steps return hidden states, every talker step takes an embedding; a
    # thinker step launched ahead (lookahead.py) replays the same graphs
    assert replays["thinker"] >= 10 and replays["talker"] >= 10, replays
