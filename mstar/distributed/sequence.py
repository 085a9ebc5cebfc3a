"""One rank's share of a token sequence split evenly over a sequence-parallel group.

A sequence of L tokens is padded at the end to P * ceil(L / P) and cut into P equal, consecutive
shards (rank r holds tokens r * L/P onwards), the layout `ulysses_attention` expects. Only the last
rank(s) can hold padding; `gather` drops it again.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mstar.distributed.ulysses import group_size, ulysses_attention


class SequenceShard:
    """Split per-token tensors for this rank, run attention across the group, gather results.

    Promises: `gather(split(x))` equals x on every rank; `attention` over split q, k, v equals full
    attention over the unsplit sequence, restricted to this rank's queries.
    """

    def __init__(self, group: Any, length: int) -> None:
        import torch.distributed as dist

        if length < 1:
            raise ValueError(f"cannot shard a sequence of {length} tokens")
        self.group = group
        self.size = group_size(group)
        self.index = dist.get_rank(group)
        self.length = length  # true tokens
        self.local = math.ceil(length / self.size)  # tokens per rank, padding included
        self.start = self.index * self.local

    @property
    def padded(self) -> bool:
        return self.local * self.size != self.length

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of x (tokens along `dim`), zero-padded at the end, contiguous."""
        if x.shape[dim] != self.length:
            raise ValueError(f"expected {self.length} tokens along dim {dim}, got shape {tuple(x.shape)}")
        if self.padded:
            pad = list(x.shape)
            pad[dim] = self.local * self.size - self.length
            x = torch.cat((x, x.new_zeros(pad)), dim=dim)
        return x.narrow(dim, self.start, self.local).contiguous()

    def split_groups(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's share of per-group values: x has G groups along `dim`, each covering L/G
        consecutive tokens (G = 1: one value for all). Keeps whole groups when the shard boundaries
        fall between groups, else expands to one value per token."""
        groups = x.shape[dim]
        if groups == 1:
            return x
        if self.length % groups:
            raise ValueError(f"{groups} groups do not tile a sequence of {self.length} tokens")
        per = self.length // groups
        if not self.padded and self.local % per == 0:
            return x.narrow(dim, self.start // per, self.local // per).contiguous()
        return self.split(x.repeat_interleave(per, dim=dim), dim)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Ulysses attention over the group for this rank's q, k, v [B, L/P, H, D]; padded keys masked."""
        return ulysses_attention(q, k, v, self.group, seq_len=self.length if self.padded else None)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's shard of x joined along `dim`, padding dropped; the same on every rank."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim).narrow(dim, 0, self.length)
