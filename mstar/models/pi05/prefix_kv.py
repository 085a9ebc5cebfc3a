"""The paged cache of prefix keys and values: every Gemma layer's K/V for the prefixes of requests in flight.

A prefix is written once (walk `prefix`) and read by every flow step of its chunk (walk `act`), then
released. Pages of `page_size` tokens come from one preallocated pool, so memory is fixed at start and
requests of any prefix length share it without fragmenting. A batch of action chunks reads its requests'
prefixes through a page table (`page_table` on the host, `gather` on the device): one padded [B, P, KV, D]
batch per layer, gathered once for all the chunk's flow steps; at a fixed table width its shapes are fixed,
so the whole flow can replay from a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.engines.cuda_graphs import to_device_async


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
        return to_device_async(torch.cat(slots), device)

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store packed keys and values [T, KV, D] of `layer` at `slots` [T]."""
        flat_shape = (-1, *self.keys.shape[3:])
        self.keys[layer].view(flat_shape)[slots] = keys.to(self.keys.dtype)
        self.values[layer].view(flat_shape)[slots] = values.to(self.values.dtype)

    def page_table(self, request_ids: list[str], width: int | None = None) -> torch.Tensor:
        """A host table [B, width + 1]: each prefix's pages (page 0 past its last), then its token count;
        `width` defaults to the longest prefix's pages."""
        held = [self.held[rid] for rid in request_ids]
        width = max(len(h.pages) for h in held) if width is None else width
        table = torch.zeros(len(held), width + 1, dtype=torch.long)
        for row, h in enumerate(held):
            assert len(h.pages) <= width, f"a prefix of {len(h.pages)} pages in a table {width} wide"
            table[row, :len(h.pages)] = torch.tensor(h.pages, dtype=torch.long)
            table[row, -1] = h.tokens
        return table

    def gather(self, table: torch.Tensor) -> PrefixBatch:
        """The prefixes of a device `page_table` as one padded batch; device work only, of shapes fixed by
        the table's (so a CUDA graph may hold it)."""
        pages, lengths = table[:, :-1], table[:, -1]
        keys, values = self.keys[:, pages].flatten(2, 3), self.values[:, pages].flatten(2, 3)
        valid = torch.arange(keys.shape[2], device=keys.device)[None, :] < lengths[:, None]
        return PrefixBatch(keys, values, valid, lengths)

    def view(self, request_ids: list[str]) -> PrefixBatch:
        """The prefixes of `request_ids` as one padded batch."""
        return self.gather(to_device_async(self.page_table(request_ids), self.keys.device))


@dataclass(frozen=True)
class PrefixBatch:
    """A batch of prefixes read out of the pool: every layer's keys and values [layers, B, P, KV, D] (P the
    table's pages times page_size), valid where `valid` [B, P]; `lengths` [B] are their tokens."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    lengths: torch.Tensor

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values [B, P, KV, D]."""
        return self.keys[index], self.values[index]
