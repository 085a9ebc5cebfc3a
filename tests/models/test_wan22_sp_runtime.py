"""The DiT on a 2-rank sequence-parallel replica (mstar/configs/wan22_sp2.yaml: 2 worker processes, gloo) gives
what one device gives; in-process mode refuses multi-rank replicas with the fix."""

from __future__ import annotations

import pytest
import torch

from mstar.config import load_config
from mstar.runtime.offline import MStar
from tests.models.wan22_testing import NEGATIVE, PROMPTS, outputs_of

OPTIONS = {"negative_prompt": NEGATIVE, "width": 64, "height": 64, "num_frames": 5, "num_inference_steps": 3,
           "guidance_scale": 5.0, "debug_outputs": True}


def _run(m) -> list[dict]:
    handles = [m.submit({"text": p}, seed=i, **OPTIONS) for i, p in enumerate(PROMPTS[:2])]
    return [outputs_of(h.result()) for h in handles]


def test_in_process_mode_refuses_multi_rank_replicas():
    with pytest.raises(ValueError, match=r"components \['dit'\] run on multi-rank replicas .* use mode='multiproc'"):
        MStar(config=load_config("wan22_sp2"), tiny=True)


@pytest.mark.slow  # a second multi-process Wan replica beside test_wan22_cfg_parallel's; the group itself: test_wan22_sequence_parallel
def test_sequence_parallel_replica_equals_one_device():
    with MStar("wan22", tiny=True) as m:
        expected = _run(m)
    with MStar(config=load_config("wan22_sp2"), mode="multiproc", tiny=True) as m:
        got = _run(m)
    for ours, want in zip(got, expected, strict=True):
        assert len(ours["steps"]) == 3
        for a, b in zip(ours["steps"], want["steps"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours["frames"], want["frames"], atol=1e-4, rtol=0)
