"""A spoken answer's thinker steps launched ahead through the extras graph (`lookahead.py`,
`ExtrasGraphs.appended_inputs`) and the thinker on a CUDA stream of its own (`engines/own_stream.py`), alone
and together, serve tiny Qwen3-Omni on CUDA with the same text and audio as the plain path (no lookahead,
one stream), and every request speaks: thinker and talker ignore EOS, so an answer without audio is a
bug, not the model's choice.

The earlier form of this test served in float32, where the MoE thinker and talker capture no decode
graphs (`moe_graph_capturable`: the grouped path serves bfloat16 only), so nothing was launched ahead
and its two runs differed only by the thinker's stream. Here:
- float32, every SparseMoE forced onto the small-batch kernels (capturable in float32), three requests
  in flight: the thinker and talker decode through graphs and the thinker launches ahead; how requests
  join batches depends on timing, so audio is compared within float32 rounding;
- bfloat16 as served, one request at a time: batches are the same in both runs, so outputs must match
  to the bit, while each request's forwards launched ahead run beside its own talk loop.

Run on the lent machine: `python3 -m pytest -q -m gpu tests/gpu/test_extras_lookahead_gpu.py`.
"""

from __future__ import annotations

import contextlib
import gc
from unittest import mock

import numpy as np
import pytest
import torch

from mstar.engines.own_stream import OwnStreamEngine
from mstar.layers.moe import SparseMoE
from mstar.runtime.offline import MStar

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CHATS = [{"messages": [{"role": "user", "content": f"Say hello to assistant number {i}."}]} for i in range(3)]
SPOKEN = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "modalities": ["text", "audio"],
          "voice": "Aiden", "talker.temperature": 0.0, "talker.max_tokens": 16, "talker.ignore_eos": True}
RUNS = {"plain": (False, False), "lookahead": (True, False), "own_stream": (False, True), "both": (True, True)}


@contextlib.contextmanager
def _small_moe(on: bool):
    """Every SparseMoE built inside takes the small-batch kernels, which CUDA graphs capture in float32."""
    if not on:
        yield
        return
    real = SparseMoE.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.force_path = "small"

    with mock.patch.object(SparseMoE, "__init__", init):
        yield


def _serve(run: str, dtype: str, together: bool):
    lookahead, stream = RUNS[run]
    gc.collect()  # the last run's runtime (reference cycles) and its KV pools go before this one sizes its own
    torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    # small KV pools: runs follow one another in this process, and a pool sized by free memory takes 90% of it
    config = {"model": "qwen3_omni", "device": "cuda", "cuda_graphs": {"lookahead": lookahead},
              "kv_cache": {"max_num_pages": 2048},
              "model_kwargs": {"code2wav_chunk": 4, "dtype": dtype}, "engines": {"thinker": {"own_stream": stream}}}
    with _small_moe(dtype == "float32"), MStar("qwen3_omni", config=config, tiny=True) as m:
        thinker = m.runtime.workers[0].engines["thinker"]
        assert isinstance(thinker, OwnStreamEngine) == stream, run
        thinker = thinker.engine if stream else thinker  # the wrapped engine's internals
        assert thinker.runner.extras_graphs is not None, f"{run}: the thinker captured no extras graphs"
        if together:
            handles = [m.submit(chat, **SPOKEN) for chat in CHATS]  # in flight together
            results = [h.decoded() for h in handles]
        else:
            results = [m.submit(chat, **SPOKEN).decoded() for chat in CHATS]
        hits = thinker.lookahead_steps
    del thinker, m
    answers = []
    for i, r in enumerate(results):
        assert "audio" in r.outputs, f"{run}: request {i} finished without audio (text {r.outputs.get('text')})"
        answers.append(("".join(r.outputs["text"]), [len(a) for a in r.outputs["audio"]],
                        np.concatenate(r.outputs["audio"])))
    if lookahead:
        assert hits > 0, f"{run}: no thinker step was launched ahead"
    return answers


def _same(run: str, want, got, atol: float) -> None:
    for i, ((text_w, chunks_w, audio_w), (text_g, chunks_g, audio_g)) in enumerate(zip(want, got, strict=True)):
        assert text_w and text_g == text_w, (run, i)
        assert chunks_g == chunks_w, (run, i, chunks_g, chunks_w)
        np.testing.assert_allclose(audio_g, audio_w, atol=atol, err_msg=f"{run}: request {i}")


@pytest.fixture(scope="module")
def plain_float32():
    return _serve("plain", "float32", together=True)


@pytest.mark.parametrize("run", ["lookahead", "own_stream", "both"])
def test_in_flight_float32_same_as_plain(plain_float32, run):
    _same(run, plain_float32, _serve(run, "float32", together=True), atol=1e-3)


def test_one_at_a_time_bfloat16_same_as_plain():
    _same("both", _serve("plain", "bfloat16", together=False), _serve("both", "bfloat16", together=False),
          atol=1e-6)
