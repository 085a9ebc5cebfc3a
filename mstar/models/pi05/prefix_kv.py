"""The paged cache of prefix keys and values: every Gemma layer's K/V for the prefixes of requests in flight.

A prefix is written once (walk `prefix`) and read by every flow step of its chunk (walk `act`), then
released. Pages of `page_size` tokens come from one preallocated pool, so memory is fixed at start and
requests of any prefix length share it without fragmenting. A batch of prefixes is written, and a batch of
action chunks reads its requests' prefixes, through a page table (`page_table` on the host, `write` and
`gather` on the device): whole pages, one padded [B, P, KV, D] batch per layer; at a fixed table width the
shapes are fixed, so the prefix forward and the whole flow can replay from CUDA graphs.

Page 0 is the pool's sink: no prefix holds it, a table names it past each prefix's last page, so padding
is written there and read from there (masked), and a graph's warm-up over a zero table writes only there.
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
    """Keys and values [layers, 1 + pages, page_size, KV heads, head_dim]: the sink (page 0) and `num_pages`
    pages to hand out, with a free list."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (layers, 1 + num_pages, page_size, kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self._free = list(range(num_pages, 0, -1))  # popped from the end: low pages first; never the sink
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

    def page_table(self, request_ids: list[str], width: int | None = None) -> torch.Tensor:
        """A host table [B, width + 1]: each prefix's pages (the sink, page 0, past its last), then its token
        count; `width` defaults to the longest prefix's pages."""
        held = [self.held[rid] for rid in request_ids]
        width = max(len(h.pages) for h in held) if width is None else width
        for h in held:
            assert len(h.pages) <= width, f"a prefix of {len(h.pages)} pages in a table {width} wide"
        return torch.tensor([[*h.pages, *(0,) * (width - len(h.pages)), h.tokens] for h in held], dtype=torch.long)

    def write(self, layer: int, table: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys and values [B, pages * page_size, KV, D] of `layer` in the pages of a device `page_table`
        [B, pages + 1], whole pages (what lies past a prefix's end lands in its last page or the sink);
        device work only, of shapes fixed by the table's."""
        pages = table[:, :-1]
        shape = (*pages.shape, self.page_size, *self.keys.shape[3:])
        self.keys[layer][pages] = keys.reshape(shape).to(self.keys.dtype)
        self.values[layer][pages] = values.reshape(shape).to(self.values.dtype)

    def gather(self, table: torch.Tensor) -> PrefixBatch:
        """The prefixes of a device `page_table` as one padded batch; device work only, of shapes fixed by
        the table's (so a CUDA graph may hold it)."""
        pages, lengths = table[:, :-1], table[:, -1]
        return PrefixBatch(self.keys[:, pages].flatten(2, 3), self.values[:, pages].flatten(2, 3), lengths)

    def view(self, request_ids: list[str]) -> PrefixBatch:
        """The prefixes of `request_ids` as one padded batch."""
        return self.gather(to_device_async(self.page_table(request_ids), self.keys.device))


@dataclass(frozen=True)
class PrefixBatch:
    """A batch of prefixes read out of the pool: every layer's keys and values [layers, B, P, KV, D] (P the
    table's pages times page_size), of which each prefix's first `lengths` [B] are its tokens."""

    keys: torch.Tensor
    values: torch.Tensor
    lengths: torch.Tensor

    @property
    def valid(self) -> torch.Tensor:
        """[B, P]: which rows hold a prefix's tokens."""
        return torch.arange(self.keys.shape[2], device=self.keys.device)[None, :] < self.lengths[:, None]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values [B, P, KV, D]."""
        return self.keys[index], self.values[index]
