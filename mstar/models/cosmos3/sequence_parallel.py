"""Ulysses sequence parallelism for the Cosmos3 generation tower, over packed rows of different lengths.

Every rank of a group of P holds every row's prompt keys and values (the understanding tower is
replicated) and 1/P of each row's generated tokens: row i is padded at its end to P * ceil(n_i / P) and
rank r keeps its r-th slice, the rows' slices packed one after another. Per layer one all-to-all turns
the packed local queries (and one the keys with the values) into whole rows with 1/P of the heads,
each row attends over its prompt's keys of those heads and its own, unpadded, and one all-to-all
turns the result back. Heads and key-value heads must divide by P, so each rank's query heads read
only its own key-value heads. `gather` gives every rank every row's tokens again, padding dropped.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from mstar.distributed.ulysses import check_heads, group_size, heads_to_sequence, sequence_to_heads


class RowShards:
    """This rank's share of packed rows of `lengths` tokens (see the module docstring)."""

    def __init__(self, group: Any, lengths: list[int], device: torch.device | str = "cpu") -> None:
        import torch.distributed as dist

        self.group, self.size, self.rank = group, group_size(group), dist.get_rank(group)
        self.lengths = lengths
        self.local = [math.ceil(n / self.size) for n in lengths]  # tokens per rank of each row
        starts = torch.tensor([0, *self.local]).cumsum(0).tolist()
        total = starts[-1]
        # position in the all-to-all's rank-major [P * total] order of token t of row i (padding dropped)
        self.order = [torch.cat([torch.arange(starts[i], starts[i] + local) + p * total for p in range(self.size)])
                      [:n].to(device) for i, (n, local) in enumerate(zip(lengths, self.local, strict=True))]

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """Packed whole rows [sum n_i, ...] -> this rank's packed slices [sum local_i, ...] (zero padding)."""
        parts, start = [], 0
        for n, local in zip(self.lengths, self.local, strict=True):
            row = x[start:start + n]
            start += n
            padded = F.pad(row, (0, 0) * (row.dim() - 1) + (0, local * self.size - n))
            parts.append(padded[self.rank * local:(self.rank + 1) * local])
        return torch.cat(parts).contiguous()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_k: list[torch.Tensor],
               text_v: list[torch.Tensor]) -> torch.Tensor:
        """Local q [S, Hq, d], k and v [S, Hk, d] -> local attention output [S, Hq, d]; row i's queries see
        its prompt's keys `text_k[i]` [L_i, Hk, d] (all heads; this rank's are taken here) and its own."""
        heads, kv_heads = q.shape[1], k.shape[1]
        check_heads(heads, self.size)
        check_heads(kv_heads, self.size)
        qh = sequence_to_heads(q[None], self.group)[0]  # [P * S, Hq / P, d]
        kh, vh = sequence_to_heads(torch.stack((k, v))[:, None], self.group)[:, 0]
        mine = slice(self.rank * kv_heads // self.size, (self.rank + 1) * kv_heads // self.size)
        out = torch.zeros_like(qh)
        for i, index in enumerate(self.order):
            keys = torch.cat([text_k[i][:, mine], kh[index]])
            values = torch.cat([text_v[i][:, mine], vh[index]])
            attended = F.scaled_dot_product_attention(
                qh[index].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                enable_gqa=qh.shape[1] != keys.shape[1])
            out[index] = attended[0].transpose(0, 1)
        return heads_to_sequence(out[None], self.group)[0]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's packed slices [sum local_i, ...] -> packed whole rows [sum n_i, ...], on every rank."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        everything = torch.cat(parts)  # rank-major, as the all-to-all's order
        return torch.cat([everything[index] for index in self.order])
