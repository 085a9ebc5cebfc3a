"""The paged cache of prefix keys and values: every Gemma layer's K/V for the prefixes of requests in flight.

A prefix is written once (walk `prefix`) and read by every flow step of its chunk (walk `act`), then
released. Pages of `page_size` tokens come from one preallocated pool, so memory is fixed at start and
requests of any prefix length share it without fragmenting; a batch of flow steps gathers its requests'
pages into one padded [B, P, KV, D] view per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PoolFull(RuntimeError):
    """No pages left for a new prefix."""


@dataclass(frozen=True)
class Held:
    """One request's prefix in the pool."""

    pages: tuple[int, ...]
    tokens: int


class PrefixKVPool:
    """Keys and values [layers, pages, page_size, KV heads, head_dim] with a free list of pages."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (layers, num_pages, page_size, kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: low pages first
        self.held: dict[str, Held] = {}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str, tokens: int) -> Held:
        """Pages for a prefix of `tokens` tokens; PoolFull when they are not there."""
        assert request_id not in self.held, f"{request_id} already holds a prefix"
        count = -(-tokens // self.page_size)
        if count > len(self._free):
            raise PoolFull(f"the prefix cache has {len(self._free)} free pages, a prefix of {tokens} tokens needs "
                           f"{count}: too many robots in flight (raise model_kwargs.max_robots)")
        held = Held(tuple(self._free.pop() for _ in range(count)), tokens)
        self.held[request_id] = held
        return held

    def release(self, request_id: str) -> None:
        """Give a request's pages back (nothing for a request that holds none)."""
        held = self.held.pop(request_id, None)
        if held is not None:
            self._free.extend(reversed(held.pages))

    def slots(self, request_ids: list[str], device: torch.device) -> torch.Tensor:
        """The flat slot (page * page_size + offset) of every token of these prefixes, one after another."""
        slots = []
        for rid in request_ids:
            held = self.held[rid]
            pages = torch.tensor(held.pages, dtype=torch.long)
            offsets = torch.arange(held.tokens)
            slots.append(pages[offsets // self.page_size] * self.page_size + offsets % self.page_size)
        return torch.cat(slots).to(device)

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store packed keys and values [T, KV, D] of `layer` at `slots` [T]."""
        flat_shape = (-1, *self.keys.shape[3:])
        self.keys[layer].view(flat_shape)[slots] = keys.to(self.keys.dtype)
        self.values[layer].view(flat_shape)[slots] = values.to(self.values.dtype)

    def view(self, request_ids: list[str]) -> PrefixView:
        """The prefixes of `request_ids` as one padded batch."""
        held = [self.held[rid] for rid in request_ids]
        width = max(len(h.pages) for h in held)
        table = torch.zeros(len(held), width, dtype=torch.long)
        for row, h in enumerate(held):
            table[row, :len(h.pages)] = torch.tensor(h.pages, dtype=torch.long)
        device = self.keys.device
        lengths = torch.tensor([h.tokens for h in held], device=device)
        valid = torch.arange(width * self.page_size, device=device)[None, :] < lengths[:, None]
        return PrefixView(self, table.to(device), valid, lengths)


class PrefixView:
    """A batch of prefixes in the pool: `layer(i)` gathers layer i's keys and values [B, P, KV, D] (P the
    longest prefix's pages times page_size), valid where `valid` [B, P]; `lengths` [B] are their tokens."""

    def __init__(self, pool: PrefixKVPool, table: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor) -> None:
        self.pool, self.table, self.valid, self.lengths = pool, table, valid, lengths

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.keys[index][self.table].flatten(1, 2), self.pool.values[index][self.table].flatten(1, 2)
