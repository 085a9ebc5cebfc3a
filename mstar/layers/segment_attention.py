"""Bidirectional attention within segments of a packed sequence (the encoders' `cu_seqlens` attention).

Tokens of several images, frames or audio windows lie one after another; each attends only to the
tokens of its own segment. Segments of equal length are gathered into one SDPA batch, so there is no
mask and no padding, and on GPU SDPA picks its flash kernel: encoders have few distinct lengths
(every frame of a video and every full audio window are alike). When every segment has one length
(a batch of same-size images) the packed sequence is viewed as that batch, with no gather at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    """Lengths of the segments bounded by `cu_seqlens` [num_segments + 1]."""
    return (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()


class SegmentPlan:
    """Gather indices grouping a packed sequence's segments by length; built once, used by every layer.
    `uniform` is the one length when every segment has it (then no index is built)."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        if any(n <= 0 for n in lengths):
            raise ValueError(f"attention segments must be non-empty, got lengths {lengths}")
        starts, offset = [], 0
        for n in lengths:
            starts.append(offset)
            offset += n
        self.total = offset
        self.uniform = lengths[0] if len(set(lengths)) == 1 else None
        self.groups: list[tuple[int, torch.Tensor]] = []  # (length, token indices [num_segments * length])
        for length in sorted(set(lengths)) if self.uniform is None else ():
            seg_starts = torch.tensor([s for s, n in zip(starts, lengths) if n == length], dtype=torch.long)
            index = (seg_starts[:, None] + torch.arange(length)[None, :]).reshape(-1)
            self.groups.append((length, index.to(device)))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
    """q, k, v [T, heads, head_dim] -> [T, heads, head_dim]: softmax(q k^T / sqrt(d)) v per segment."""
    if q.shape[0] != plan.total:
        raise ValueError(f"packed sequence has {q.shape[0]} tokens but the segments cover {plan.total}")
    heads, dim = q.shape[1], q.shape[2]
    if plan.uniform is not None:  # segments of one length lie in order: the packed rows are their batch
        shape = (-1, plan.uniform, heads, dim)
        return _sdpa(q.view(shape), k.view(shape), v.view(shape)).reshape(q.shape)
    out = torch.empty_like(q)
    for length, index in plan.groups:
        shape = (-1, length, heads, dim)
        out[index] = _sdpa(q[index].view(shape), k[index].view(shape), v[index].view(shape)).reshape(
            -1, heads, dim
        )
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[B, L, H, D] in and out."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)
