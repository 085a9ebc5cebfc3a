"""Qwen3-Omni's thinker split over 2 ranks (heads and experts; `Qwen3OmniThinker.tp`), loaded from the tiny
reference checkpoint in the Hub layout (per-expert tensors: each rank takes its rows of q/k/v, its columns
of o_proj and its experts), on CPU over gloo: the same final states and logits as the whole thinker in
one process (float32), and a KV layout of its own KV heads."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from sp_testing import run_ranks

from tests.models.qwen3_omni_model_testing import PROMPT, make_reference

pytest.importorskip("transformers")


class _CausalBackend:
    """The attention a prefill of the whole prompt needs: causal over the step's tokens, no cache."""

    def forward(self, layer_idx, q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(0, 1)


def _compare(replica, device, folder) -> dict:
    from mstar.layers.attention import HeadShard
    from mstar.models.qwen3_omni.weights import load_thinker

    whole = load_thinker(folder, dtype=torch.float32, progress=False)
    part = load_thinker(folder, dtype=torch.float32, progress=False,
                        tp=HeadShard(replica.index, replica.size, replica.group))
    ids = torch.tensor(PROMPT)
    positions = torch.arange(len(PROMPT)).expand(3, -1)
    with torch.no_grad():
        want, got = whole(ids, positions, _CausalBackend()), part(ids, positions, _CausalBackend())
        logits_w, logits_g = whole.compute_logits(want), part.compute_logits(got)
    return {"hidden": (got - want).abs().max().item(), "scale": want.abs().max().item(),
            "logits": (logits_g - logits_w).abs().max().item(), "greedy_equal": torch.equal(
                logits_g.argmax(-1), logits_w.argmax(-1)),
            "kv_heads": (part.kv_layout.num_kv_heads, whole.kv_layout.num_kv_heads),
            "experts": part.model.layers[0].mlp.experts.gate_up_proj.shape[0]}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("omni_reference")
    make_reference(folder)
    return run_ranks(partial(_compare, folder=str(folder)), 2, "cpu", tmp_path_factory.mktemp("thinker_tp"))


def test_two_ranks_give_the_whole_thinker(ranks):
    for result in ranks:
        assert result["scale"] > 0.1
        assert result["hidden"] < 1e-4 and result["logits"] < 1e-4, result
        assert result["greedy_equal"]
        assert result["kv_heads"] == (1, 2) and result["experts"] == 4  # half of each on each rank
