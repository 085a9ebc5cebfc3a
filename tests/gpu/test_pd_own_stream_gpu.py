"""Prefill/decode disaggregation of tiny Qwen3-Omni on one GPU with the thinker on a CUDA stream of its own
(`engines/own_stream.py`, `KVOwnStreamEngine`) on both workers: the media prefill on one worker, the thinker's
decode and the speech on the other (tests/models/test_pd_kv_transfer.py's OMNI_PD). The thinker's K/V stream
layer by layer from the prefill worker's stream to the decode worker's (two processes: by CUDA IPC; one
process: the tensors themselves between two worker threads), the decode worker computes no prompt token, and
an image+audio prompt and a text prompt give the text of one worker serving everything.

Run on the lent machine: `python3 -m pytest -q -m gpu tests/gpu/test_pd_own_stream_gpu.py`.
"""

from __future__ import annotations

import gc

import pytest
import torch

from mstar.config import config_from_dict
from mstar.engines.own_stream import KVOwnStreamEngine
from mstar.runtime.offline import MStar
from tests.models.qwen3_omni_testing import media_chat_request
from tests.models.test_pd_kv_transfer import OMNI_OPTIONS, OMNI_PD, _gauges

# small KV pools: two workers share the card, and a pool sized by free memory takes most of it
KV = {"page_size": 16, "max_num_pages": 512}
THINKER_ON_ITS_STREAM = {"thinker": {"own_stream": True}}
REQUESTS = [{"messages": [{"role": "user", "content": "Say something."}]}, media_chat_request()]


def _fresh() -> None:
    """The last run's runtime and KV pools go before the next one sizes its own."""
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def one_worker() -> list[dict]:
    _fresh()
    config = {"model": "qwen3_omni", "device": "cuda", "model_kwargs": OMNI_PD["model_kwargs"], "kv_cache": KV,
              "engines": THINKER_ON_ITS_STREAM}
    with MStar("qwen3_omni", config=config_from_dict(config), tiny=True) as m:
        return [m.generate(r, **OMNI_OPTIONS).outputs for r in REQUESTS]


@pytest.mark.parametrize("mode", ["multiproc", "inproc"])
def test_thinker_on_its_own_stream_streams_its_kv(one_worker, mode):
    _fresh()
    config = config_from_dict({**OMNI_PD, "device": "cuda", "kv_cache": KV, "engines": THINKER_ON_ITS_STREAM})
    with MStar("qwen3_omni", config=config, mode=mode, tiny=True) as split:
        if mode == "inproc":  # the workers' engines are reachable in this process
            for rank in (0, 1):
                assert isinstance(split.runtime.workers[rank].engines["thinker"], KVOwnStreamEngine), rank
        results = [split.generate(r, **OMNI_OPTIONS) for r in REQUESTS]
        stats = _gauges(split, "thinker", lambda s: s.get(1, {}).get("kv_pages_received", 0) >= len(REQUESTS)
                        and s[1]["kv_pages_received"] == s.get(0, {}).get("kv_pages_sent"))
    for i, (want, got) in enumerate(zip(one_worker, results, strict=True)):
        assert "".join(want["text"]) and got.outputs["text"] == want["text"], (mode, i)
        assert ("audio" in got.outputs) == ("audio" in want), (mode, i)  # the talk loop ran beside the thinker
    assert stats[1]["prompt_tokens"] == 0 and stats[1]["kv_pages_received"] >= len(REQUESTS), stats
    assert stats[0]["prompt_tokens"] > 0 and stats[0]["kv_pages_sent"] == stats[1]["kv_pages_received"], stats
