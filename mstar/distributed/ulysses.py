"""Ulysses sequence parallelism: attention over a sequence sharded across the ranks of a group.

Each of P ranks holds L/P consecutive tokens with all H heads. One all-to-all trades that for all L
tokens with H/P heads, each rank runs ordinary attention on its heads, and a second all-to-all
trades back: each rank sends about 4 * (L/P) * H * D values per attention (q, k, v, then the result).

Uneven lengths: the caller pads the sequence to a multiple of P (pad at the end, so only the last
rank holds padding) and passes the true length as `seq_len`; padded keys are masked out, and
outputs at padded query positions are meaningless and must be dropped by the caller.
`SequenceShard` (sequence.py) does that bookkeeping. Inference only: the collectives carry no
gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def group_size(group: Any) -> int:
    """Number of ranks in a torch.distributed group."""
    import torch.distributed as dist

    return dist.get_world_size(group)


def check_heads(heads: int, size: int) -> None:
    """Ulysses gives each rank heads/size heads: raise unless `size` divides `heads`."""
    if heads % size:
        raise ValueError(f"Ulysses sequence parallelism needs the head count to divide by the group size: "
                         f"{heads} heads over sp_size={size}; choose an sp_size that divides {heads}")


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Exchange dim-0 slices: slice j goes to rank j; the result's slice j came from rank j."""
    import torch.distributed as dist

    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like keeps strides, the collective assumes dense
    dist.all_to_all_single(out, x, group=group)
    return out


def sequence_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[..., B, L/P, H, D] sharded by sequence -> [..., B, L, H/P, D] sharded by heads.

    Leading dims (e.g. q, k, v stacked) ride along, so one collective moves all three.
    """
    size = group_size(group)
    *lead, batch, local, heads, dim = x.shape
    check_heads(heads, size)
    n = len(lead)
    # [..., B, Lp, P, H/P, D] -> [P, ..., B, Lp, H/P, D]: chunk j of the heads goes to rank j
    x = x.reshape(*lead, batch, local, size, heads // size, dim).movedim(n + 2, 0)
    x = _all_to_all(x, group)  # now slice j holds rank j's tokens, our heads
    x = x.movedim(0, n + 1)  # [..., B, P, Lp, H/P, D]: rank order is sequence order
    return x.reshape(*lead, batch, size * local, heads // size, dim)


def heads_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, L, H/P, D] sharded by heads -> [B, L/P, H, D] sharded by sequence (inverse of the above)."""
    size = group_size(group)
    batch, length, heads, dim = x.shape
    x = x.reshape(batch, size, length // size, heads, dim).movedim(1, 0)  # token chunk j goes to rank j
    x = _all_to_all(x, group)  # slice j holds our tokens, rank j's heads
    return x.movedim(0, 2).reshape(batch, length // size, size * heads, dim)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                      seq_len: int | None = None) -> torch.Tensor:
    """Attention of local queries over the whole sequence: q, k, v and the result are [B, L/P, H, D].

    Every rank of `group` holds the same-size shard (rank r: tokens r*L/P .. (r+1)*L/P). `seq_len` is
    the true length when the sequence was padded at the end; keys beyond it are masked. Heads must
    divide by the group size (ValueError otherwise). Numerically this is torch SDPA on the gathered
    sequence, head by head.
    """
    if not q.shape == k.shape == v.shape:
        raise ValueError(f"ulysses_attention needs q, k, v of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    qh, kh, vh = sequence_to_heads(torch.stack((q, k, v)), group).unbind(0)
    length = qh.shape[1]
    mask = None
    if seq_len is not None and seq_len < length:
        mask = (torch.arange(length, device=q.device) < seq_len).view(1, 1, 1, length)  # keys; all queries, heads
    out = F.scaled_dot_product_attention(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2),
                                         attn_mask=mask)
    return heads_to_sequence(out.transpose(1, 2), group)
