"""Packed segment attention (`layers/segment_attention.py`) against one SDPA call per segment."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar.layers.segment_attention import SegmentPlan, segment_attention


def _per_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    parts = [F.scaled_dot_product_attention(a.transpose(0, 1), b.transpose(0, 1), c.transpose(0, 1)).transpose(0, 1)
             for a, b, c in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)]
    return torch.cat(parts)


@pytest.mark.parametrize("lengths", [[7], [5, 5, 5], [3, 6, 3, 1, 6]])
def test_each_segment_attends_only_to_itself(lengths: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(sum(lengths), 3, 2, 4, generator=g)
    q, k, v = qkv.unbind(1)  # strided views, as the encoders' fused projections give them
    plan = SegmentPlan(lengths, q.device)
    assert (plan.uniform is not None) == (len(set(lengths)) == 1)
    got = segment_attention(q, k, v, plan)
    torch.testing.assert_close(got, _per_segment(q, k, v, lengths), atol=1e-6, rtol=0)


def test_a_plan_refuses_a_sequence_of_another_length() -> None:
    q = torch.zeros(4, 1, 2)
    with pytest.raises(ValueError, match="4 tokens"):
        segment_attention(q, q, q, SegmentPlan([2, 3], q.device))
    with pytest.raises(ValueError, match="non-empty"):
        SegmentPlan([2, 0], q.device)
