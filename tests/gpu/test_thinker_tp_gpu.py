"""Qwen3-Omni's thinker tensor-parallel over 2 GPUs (NCCL), from the tiny reference checkpoint in bf16:
the same logits as the whole thinker (bf16 tolerance) and greedy tokens (but for near-ties), and the sharded forward,
its all-reduces inside, captured in a CUDA graph replays to the eager result.

Run on a lent machine with two GPUs: `python3 -m pytest -q -m gpu tests/gpu/test_thinker_tp_gpu.py`.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.models.qwen3_omni_model_testing import PROMPT, make_reference
from tests.models.qwen3_omni_testing import FullAttention
from tests.models.sp_testing import run_ranks

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def _compare(replica, device, folder) -> dict:
    from mstar.layers.attention import HeadShard
    from mstar.models.qwen3_omni.weights import load_thinker

    whole = load_thinker(folder, dtype=torch.bfloat16, device=device, progress=False)
    part = load_thinker(folder, dtype=torch.bfloat16, device=device, progress=False,
                        tp=HeadShard(replica.index, replica.size, replica.group))
    ids = torch.tensor(PROMPT, device=device)
    positions = torch.arange(len(PROMPT), device=device).expand(3, -1)
    with torch.inference_mode():
        want = whole.compute_logits(whole(ids, positions, FullAttention()))
        got = part.compute_logits(part(ids, positions, FullAttention()))
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            part(ids, positions, FullAttention())  # warm up on the side stream before capture
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = part.compute_logits(part(ids, positions, FullAttention()))
        graph.replay()
        torch.cuda.synchronize(device)
    return {"logits": (got - want).abs().max().item(), "scale": want.abs().max().item(),
            "greedy_equal": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
            "graph": (captured - got).abs().max().item()}


def test_two_gpus_give_the_whole_thinker(tmp_path):
    folder = tmp_path / "reference"
    folder.mkdir()
    make_reference(folder)
    (tmp_path / "ranks").mkdir()
    for result in run_ranks(partial(_compare, folder=str(folder)), 2, "cuda", tmp_path / "ranks"):
        assert result["scale"] > 0.1
        assert result["logits"] < 0.05 * result["scale"], result  # bf16, summed in another order
        assert result["greedy_equal"] >= 0.9, result  # near-ties of random bf16 logits may flip a few
        assert result["graph"] < 0.01 * result["scale"], result  # the replay computes what eager computed
