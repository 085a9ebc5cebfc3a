"""A spoken answer's thinker steps launched ahead through the extras graph (engines/autoregressive/lookahead.py,
`ExtrasGraphs.appended_inputs`), served end to end on CPU: tiny Qwen3-Omni with the thinker's and talker's decode
graphs stood in for (tests/unit/graph_standins.py: the captured function runs eagerly; its outputs are
buffers the next replay rewrites, as a graph pool's are), three spoken answers in flight, gives each request
the same text and audio with lookahead as without, and the thinker's forwards launched ahead are used.
On CPU nothing runs on a second stream: `tests/gpu/test_extras_lookahead_gpu.py` is the CUDA side."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

from mstar.engines.autoregressive import engine as engine_module
from mstar.engines.autoregressive import extras_graph, runner
from mstar.engines.autoregressive.extras_graph import ExtrasGraphs
from mstar.runtime.offline import MStar
from tests.unit.graph_standins import PoolGraphs, SharedSDPA

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

CHATS = [{"messages": [{"role": "user", "content": f"Say hello to assistant number {i}."}]} for i in range(3)]
SPOKEN = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "modalities": ["text", "audio"],
          "voice": "Aiden", "talker.temperature": 0.0, "talker.max_tokens": 16, "talker.ignore_eos": True}
SIZES = [1, 2, 4, 8]


def _graphed_runner_init(real):
    """ModelRunner.__init__, then decode and extras graphs (stand-ins) where CUDA would capture them."""
    def init(self, model, attn, page_size, device, graphs=None, max_num_seqs=256):
        real(self, model, attn, page_size, device, graphs, max_num_seqs)
        if graphs is not None and graphs.enabled:
            self.graphs = self._capture(SIZES)
            if getattr(model, "graph_hidden_layers", None):
                self.extras_graphs = ExtrasGraphs(model, attn, self.device)
                self.extras_graphs.capture(SIZES, self._describe_dummy_batch)
    return init


def _backend(name, layout, num_pages, page_size, device, max_num_seqs=256, max_pages_per_seq=None):
    return SharedSDPA(layout, num_pages, page_size, device, max_num_seqs, max_pages_per_seq or num_pages)


def _serve(lookahead: bool):
    config = {"model": "qwen3_omni", "device": "cpu", "model_kwargs": {"code2wav_chunk": 4},
              "cuda_graphs": {"lookahead": lookahead, "sampling": False, "max_batch_size": max(SIZES)}}
    with mock.patch.object(runner.ModelRunner, "__init__", _graphed_runner_init(runner.ModelRunner.__init__)), \
            mock.patch.object(engine_module, "make_attention_backend", _backend), \
            mock.patch.object(runner, "BatchGraphs", PoolGraphs), \
            mock.patch.object(extras_graph, "BatchGraphs", PoolGraphs), \
            MStar("qwen3_omni", config=config, tiny=True) as m:
        handles = [m.submit(chat, **SPOKEN) for chat in CHATS]  # in flight together
        results = [h.decoded() for h in handles]
        engines = m.runtime.workers[0].engines
    answers = [("".join(r.outputs["text"]), np.concatenate(r.outputs.get("audio") or [np.zeros(0, np.float32)]))
               for r in results]
    return answers, engines["thinker"], engines["talker"]


def test_spoken_thinker_steps_launched_ahead_change_nothing():
    want, thinker_plain, _ = _serve(False)
    got, thinker, talker = _serve(True)
    # the three answers decode mostly as one batch of about 12 thinker steps (how the prefills join depends
    # on when the requests reach the worker): most of them were launched ahead
    assert thinker_plain.lookahead_steps == 0 and thinker.lookahead
    assert thinker.lookahead_steps >= 6, thinker.lookahead_steps
    assert talker.lookahead and talker.lookahead_steps == 0  # a multi-node loop: never an engine loop
    for i, ((text_w, audio_w), (text_g, audio_g)) in enumerate(zip(want, got, strict=True)):
        assert text_w and text_g == text_w, i
        assert audio_w.size > 0 and audio_g.shape == audio_w.shape, (i, audio_g.shape, audio_w.shape)
        # Code2Wav's batches of chunks may differ between the runs (timing): float32 rounding only
        np.testing.assert_allclose(audio_g, audio_w, atol=1e-4, err_msg=f"request {i}")
