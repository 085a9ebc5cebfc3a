"""Parallel layers on CPU, 2 spawned ranks over gloo against the whole layer in one process (float32):
expert parallelism of the sparse MoE block (`layers/moe.py`, `ExpertShard`: each rank half of the
experts; with and without a shared expert) and tensor parallelism of self-attention over heads
(`layers/attention.py`, `HeadShard`: each rank half of the q and KV heads; Qwen3's qk-norm, qkv bias).
The shards' own checks fail loudly, and so does a tensor-parallel engine whose ranks sized their KV pools
differently."""

from __future__ import annotations

import pytest
import torch

from mstar.layers.attention import AttentionSpec, HeadShard, SelfAttention
from mstar.layers.moe import ExpertShard, MoESpec, SparseMoE
from tests.models.qwen3_omni_testing import FullAttention
from tests.models.sp_testing import run_ranks

ATTENTION = {"qwen3": AttentionSpec(hidden_size=24, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True),
             "qkv_bias": AttentionSpec(hidden_size=24, num_heads=4, num_kv_heads=2, head_dim=6, qkv_bias=True)}
SPECS = {"routed": MoESpec(hidden_size=16, num_experts=8, top_k=3, intermediate_size=12),
         "shared": MoESpec(hidden_size=16, num_experts=8, top_k=2, intermediate_size=12, shared_intermediate_size=20)}


def _randomized(module: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape) * 0.3)
    return module.eval()


def _whole(spec: MoESpec) -> SparseMoE:
    return _randomized(SparseMoE(spec))


def _attention_checks(replica) -> dict:
    out = {}
    gen = torch.Generator().manual_seed(3)
    for name, spec in ATTENTION.items():
        whole = _randomized(SelfAttention(spec, 0))
        shard = HeadShard(replica.index, replica.size, replica.group)
        part = SelfAttention(spec, 0, shard).eval()
        state = whole.state_dict()
        state["qkv_proj.weight"] = shard.take_qkv(spec, state["qkv_proj.weight"])
        if spec.qkv_bias:
            state["qkv_proj.bias"] = shard.take_qkv(spec, state["qkv_proj.bias"])
        state["o_proj.weight"] = shard.take_o(spec, state["o_proj.weight"])
        part.load_state_dict(state)
        x = torch.randn(5, spec.hidden_size, generator=gen)
        angles = torch.randn(5, spec.head_dim // 2, generator=gen)
        cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
        with torch.no_grad():
            want = whole(x, cos, sin, FullAttention())
            out[f"attention_{name}"] = (part(x, cos, sin, FullAttention()) - want).abs().max().item()
            out[f"attention_{name}_scale"] = want.abs().max().item()
    return out


def _kv_pool_checks(replica) -> dict:
    """runtime/build.py refuses a tensor-parallel engine whose ranks sized their KV pools differently."""
    from mstar.runtime.build import _check_same_kv_pool

    out = {}
    _check_same_kv_pool("thinker", 64, replica)  # equal: fine
    try:
        _check_same_kv_pool("thinker", 64 + replica.index, replica)
    except ValueError as exc:
        out["kv_pool_error"] = str(exc)
    return out


def _checks(replica, device) -> dict:
    out = {**_attention_checks(replica), **_kv_pool_checks(replica)}
    for name, spec in SPECS.items():
        whole = _whole(spec)
        shard = ExpertShard(replica.index, replica.size, spec.num_experts, replica.group)
        part = SparseMoE(spec, shard).eval()
        state = whole.state_dict()
        for key in ("experts.gate_up_proj", "experts.down_proj"):
            state[key] = shard.take(state[key])
        part.load_state_dict(state)
        x = torch.randn(5, spec.hidden_size, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out[name] = (part(x) - whole(x)).abs().max().item()
            out[f"{name}_scale"] = whole(x).abs().max().item()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_checks, 2, "cpu", tmp_path_factory.mktemp("parallel_layers"))


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_two_ranks_give_the_whole_attention(ranks, name):
    for result in ranks:
        assert result[f"attention_{name}_scale"] > 0.1
        assert result[f"attention_{name}"] < 1e-5, result


@pytest.mark.parametrize("name", sorted(SPECS))
def test_two_ranks_give_the_whole_block(ranks, name):
    for result in ranks:
        assert result[f"{name}_scale"] > 0.1  # a real output, not zeros
        assert result[name] < 1e-5, result


def test_ranks_with_kv_pools_of_two_sizes_are_refused(ranks):
    for result in ranks:
        assert "sized their KV pools at [64, 65] pages; set engines.thinker.max_num_pages (or kv_cache.max_num_pages)" \
            in result["kv_pool_error"]


def test_head_shard_slices_and_checks():
    spec = AttentionSpec(hidden_size=4, num_heads=4, num_kv_heads=2, head_dim=1)
    qkv = torch.arange(8)  # rows: q0 q1 q2 q3 k0 k1 v0 v1
    assert HeadShard(1, 2, None).take_qkv(spec, qkv).tolist() == [2, 3, 5, 7]  # q2 q3 k1 v1
    assert HeadShard(1, 2, None).take_o(spec, torch.arange(8).view(2, 4)).tolist() == [[2, 3], [6, 7]]
    assert HeadShard(0, 2, None).local_spec(spec).num_kv_heads == 1
    with pytest.raises(ValueError, match="divisible"):
        HeadShard(0, 4, None).local_spec(spec)  # 2 KV heads over 4 ranks
    with pytest.raises(ValueError, match="fused qkv of 8 rows"):
        HeadShard(0, 2, None).take_qkv(spec, torch.zeros(6))


def test_shard_bounds_and_local_ids():
    shard = ExpertShard(1, 2, 8, group=None)
    assert (shard.first, shard.count) == (4, 4)
    ids = torch.tensor([[0, 5, 7], [4, 3, 6]])
    weights = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]])
    local, kept = shard.localize(ids, weights)
    assert local.tolist() == [[0, 1, 3], [0, 0, 2]]
    assert kept.flatten().tolist() == pytest.approx([0.0, 0.3, 0.2, 0.6, 0.0, 0.1])
    assert shard.take(torch.arange(8)).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="divisible"):
        ExpertShard(0, 3, 8, group=None)
    with pytest.raises(ValueError, match="expected 8 experts"):
        shard.take(torch.zeros(6, 2))
    with pytest.raises(ValueError, match="expert shard of 8"):
        SparseMoE(MoESpec(hidden_size=4, num_experts=6, top_k=2, intermediate_size=4), shard)
