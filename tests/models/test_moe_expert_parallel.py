"""Expert parallelism of the sparse MoE block (`layers/moe.py`, `ExpertShard`) on CPU: 2 spawned ranks
over gloo, each holding half of the experts, give the output of the whole block in one process
(float32), with and without a shared expert; the shard's own checks fail loudly."""

from __future__ import annotations

import pytest
import torch
from sp_testing import run_ranks

from mstar.layers.moe import ExpertShard, MoESpec, SparseMoE

SPECS = {"routed": MoESpec(hidden_size=16, num_experts=8, top_k=3, intermediate_size=12),
         "shared": MoESpec(hidden_size=16, num_experts=8, top_k=2, intermediate_size=12, shared_intermediate_size=20)}


def _whole(spec: MoESpec) -> SparseMoE:
    torch.manual_seed(0)
    block = SparseMoE(spec).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape) * 0.3)
    return block


def _checks(replica, device) -> dict:
    out = {}
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
    return run_ranks(_checks, 2, "cpu", tmp_path_factory.mktemp("moe_ep"))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_two_ranks_give_the_whole_block(ranks, name):
    for result in ranks:
        assert result[f"{name}_scale"] > 0.1  # a real output, not zeros
        assert result[name] < 1e-5, result


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
