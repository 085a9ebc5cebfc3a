"""Qwen3-Omni's thinker split over 2 ranks (heads and experts; `Qwen3OmniThinker.tp`), loaded from the tiny
reference checkpoint in the Hub layout (per-expert tensors: each rank takes its rows of q/k/v, its columns
of o_proj and its experts), on CPU over gloo: the same final states and logits as the whole thinker in
one process (float32), and a KV layout of its own KV heads; with `split_attention=False` (model_kwargs
`thinker_tp_attention: false`) only the experts are split and each rank runs whole attention."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.models.qwen3_omni_model_testing import PROMPT, make_reference
from tests.models.qwen3_omni_testing import FullAttention
from tests.models.sp_testing import run_ranks

pytest.importorskip("transformers")


def _compare(replica, device, folder) -> dict:
    from mstar.layers.attention import HeadShard
    from mstar.models.qwen3_omni.weights import load_thinker

    whole = load_thinker(folder, dtype=torch.float32, progress=False)
    ids = torch.tensor(PROMPT)
    positions = torch.arange(len(PROMPT)).expand(3, -1)
    with torch.no_grad():
        want = whole(ids, positions, FullAttention())
        logits_w = whole.compute_logits(want)
    out = {}
    for mode, split in (("heads_and_experts", True), ("experts_only", False)):
        part = load_thinker(folder, dtype=torch.float32, progress=False,
                            tp=HeadShard(replica.index, replica.size, replica.group), split_attention=split)
        with torch.no_grad():
            got = part(ids, positions, FullAttention())
            logits_g = part.compute_logits(got)
        out[mode] = {"hidden": (got - want).abs().max().item(), "scale": want.abs().max().item(),
                     "logits": (logits_g - logits_w).abs().max().item(),
                     "greedy_equal": torch.equal(logits_g.argmax(-1), logits_w.argmax(-1)),
                     "kv_heads": (part.kv_layout.num_kv_heads, whole.kv_layout.num_kv_heads),
                     "experts": part.model.layers[0].mlp.experts.gate_up_proj.shape[0],
                     "q_heads": part.model.layers[0].self_attn.spec.num_heads}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("omni_reference")
    make_reference(folder)
    return run_ranks(partial(_compare, folder=str(folder)), 2, "cpu", tmp_path_factory.mktemp("thinker_tp"))


@pytest.mark.parametrize(("mode", "kv_heads", "q_heads"), [("heads_and_experts", 1, 2), ("experts_only", 2, 4)])
def test_two_ranks_give_the_whole_thinker(ranks, mode, kv_heads, q_heads):
    for result in (r[mode] for r in ranks):
        assert result["scale"] > 0.1
        assert result["hidden"] < 1e-4 and result["logits"] < 1e-4, result
        assert result["greedy_equal"]
        assert result["experts"] == 4  # half of the experts on each rank
        assert result["kv_heads"] == (kv_heads, 2) and result["q_heads"] == q_heads  # split, or whole
