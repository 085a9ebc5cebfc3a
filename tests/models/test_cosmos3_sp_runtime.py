"""Cosmos3's DiT on a 2-rank sequence-parallel replica (mstar/configs/cosmos3_sp2.yaml: 2 worker processes,
gloo) gives what one device gives, for a video with sound and a policy batched together."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.config import load_config
from mstar.runtime.offline import MStar
from tests.models.cosmos3_testing import NEGATIVE, PROMPTS, outputs_of, pixels

REQUESTS = [({"text": PROMPTS[0]}, {"num_frames": 5, "modalities": ["video", "audio"]}),
            ({"text": PROMPTS[2], "media": [{"type": "video", "data": np.stack([pixels(3, 48, 64)] * 2)}]},
             {"modalities": ["actions"], "chunk_size": 4, "resolution_tier": 256})]
OPTIONS = {"negative_prompt": NEGATIVE, "width": 64, "height": 64, "num_inference_steps": 3, "debug_outputs": True}


def _run(m) -> list[dict]:
    handles = [m.submit(request, seed=i, **{**OPTIONS, **options}) for i, (request, options) in enumerate(REQUESTS)]
    return [outputs_of(h.result()) for h in handles]


@pytest.mark.slow  # worker processes; test_wan22_sp_runtime.py is the default run's representative
def test_sequence_parallel_replica_equals_one_device():
    with MStar("cosmos3", tiny=True) as m:
        expected = _run(m)
    with MStar(config=load_config("cosmos3_sp2"), mode="multiproc", tiny=True) as m:
        got = _run(m)
    for ours, want in zip(got, expected, strict=True):
        assert len(ours["steps"]) == 3
        for a, b in zip(ours["steps"], want["steps"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(got[0]["audio"], expected[0]["audio"], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1]["actions"], expected[1]["actions"], atol=1e-5, rtol=0)
