"""The KV context of one branch of one request, and attention over a packed batch of such branches.

A context holds, for every layer, the keys and values of the tokens a branch has seen (its prompt,
images, and generated text) and the next rope position. A forward runs new tokens of several
sequences at once: each sequence attends over its context (all of it) and its own new tokens under one
of three rules: causal (text), causal with bidirectional blocks (an image's tokens see each other
whole), or fully bidirectional (a denoising step's query block). Its new keys and values are
appended to the context only when the sequence stores them (prefill, decode); a denoising step
reads its context and leaves it unchanged, so every step of a request reuses one prefill.

Contexts live in pages of the component's paged KV pool (`PagedKVStore`, made by the stateless engine
from the `KVPoolSpec` BAGEL declares): a context is a page table and a length. A prefix of another
context (a guidance branch's) shares that context's pages by reference count and is never written: its
source writes only past its own length, hence past the prefix's. Decoding sequences (one stored token
each) attend together through the pool's paged decode attention, which stores each new key and value
and reads every row's pages in place; prefills and denoising blocks write their new keys and values
by slot and gather their context's pages for one SDPA call each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mstar.engines.base import PagedKVStore


class KVContext:
    """A page table into `pool` (`pages`, shared with the contexts of its prefix views), the tokens every
    layer holds (`length`) and the next rope position."""

    def __init__(self, pool: PagedKVStore) -> None:
        self.pool = pool
        self.pages: list[int] = []
        self.length = 0  # tokens every layer holds
        self.rope = 0  # position id of the next token
        self.view = False  # a prefix of another context, sharing its pages: never written
        self._index: torch.Tensor | None = None  # `pages` as a device tensor, while they stay the same

    def prefix(self, length: int, rope: int) -> KVContext:
        """A read-only context of this one's first `length` tokens (next position `rope`), holding their
        pages with this one: this one's later writes land beyond `length`."""
        assert length <= self.length, f"a prefix of {length} tokens of a {self.length}-token context"
        out = KVContext(self.pool)
        out.pages = self.pages[: -(-length // self.pool.page_size)]
        self.pool.share(out.pages)
        out.length, out.rope, out.view = length, rope, True
        return out

    def free(self) -> None:
        """Give the pages back (a view's stay with their other holders); the context is empty after."""
        self.pool.free(self.pages)
        self.pages, self.length, self._index = [], 0, None

    def reserve(self, tokens: int) -> torch.Tensor:
        """Slots (page * page_size + offset, int64 on the host) of `tokens` new tokens after the current
        length, pages taken from the pool as needed (again for the same tokens: no more pages)."""
        assert not self.view, "a prefix view is read-only: its pages belong to the context it was taken from"
        size = self.pool.page_size
        need = -(-(self.length + tokens) // size) - len(self.pages)
        if need > 0:
            self.pages += self.pool.allocate(need)
            self._index = None
        positions = torch.arange(self.length, self.length + tokens)
        return torch.tensor(self.pages, dtype=torch.int64)[positions // size] * size + positions % size

    def page_index(self, device: torch.device) -> torch.Tensor:
        """`pages` as an int64 tensor on `device` (made once per page table)."""
        if self._index is None or self._index.device != device:
            self._index = torch.tensor(self.pages, dtype=torch.int64).to(device, non_blocking=True)
        return self._index

    def gather(self, layer: int, k: torch.Tensor | None = None,
               v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [length (+ n), Hkv, D] of `layer`: the context's, then k/v [n, Hkv, D] if given;
        one gather of the context's pages and one copy of the new rows each."""
        cache_k, cache_v = self.pool.k_cache[layer], self.pool.v_cache[layer]
        n, size, pages = 0 if k is None else k.shape[0], self.pool.page_size, -(-self.length // self.pool.page_size)
        index = self.page_index(cache_k.device)[:pages]
        out = []
        for cache, new in ((cache_k, k), (cache_v, v)):
            buf = cache.new_empty((max(pages * size, self.length + n), *cache.shape[2:]))
            torch.index_select(cache, 0, index, out=buf[: pages * size].view(pages, *cache.shape[1:]))
            if new is not None:
                buf[self.length: self.length + n] = new
            out.append(buf[: self.length + n])
        return out[0], out[1]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [length, Hkv, D] of `layer`, gathered (to inspect them)."""
        return self.gather(layer)

    def commit(self, tokens: int, rope: int) -> None:
        """Make the `tokens` written after the current length part of the context; the next token sits at
        position `rope`."""
        self.length += tokens
        self.rope = rope


@dataclass
class QuerySpec:
    """The new tokens of one sequence in a packed forward."""

    context: KVContext | None  # what it attends over besides its own tokens (None: nothing)
    num_tokens: int
    # how its new tokens see each other: None is causal; a tensor [num_tokens] of block ids is causal
    # except that tokens of one block see each other whole; "full" is bidirectional
    blocks: torch.Tensor | str | None = None
    store: bool = False  # append the new keys and values to `context`

    def mask(self, past: int, device: torch.device) -> torch.Tensor | None:
        """Bool [num_tokens, past + num_tokens], True where a query may attend a key; None: everywhere."""
        if isinstance(self.blocks, str) or self.num_tokens == 1:  # one token sees its whole context and itself
            return None
        n = self.num_tokens
        rows = torch.arange(n, device=device)
        new = rows[None, :] <= rows[:, None]
        if self.blocks is not None:
            blocks = self.blocks.to(device, non_blocking=True)
            new = new | (blocks[None, :] == blocks[:, None])
        return torch.cat([new.new_ones((n, past)), new], dim=1)


class PackedAttention:
    """`attend(layer, q, k, v)` for a packed batch of sequences (`QuerySpec`s, their tokens one after another):
    each attends over its context and its own new tokens; stored tokens are written to the context's pages
    (reserved here, before the forward), and `commit(ropes)` makes them part of it after the last layer."""

    def __init__(self, specs: list[QuerySpec], scale: float) -> None:
        self.specs, self.scale = specs, scale
        self.bounds = [0]
        for spec in specs:
            self.bounds.append(self.bounds[-1] + spec.num_tokens)
        self.decoding = [i for i, spec in enumerate(specs) if _decodes(spec)]
        self.others = [i for i, spec in enumerate(specs) if not _decodes(spec)]
        self._decoders = [c for c in (specs[i].context for i in self.decoding) if c is not None]
        # every storing sequence's slots, on the host; on the device once the first layer needs them
        self._slots = {i: spec.context.reserve(spec.num_tokens) for i, spec in enumerate(specs)
                       if spec.store and spec.context is not None}
        self._device_slots: dict[int, torch.Tensor] = {}
        self._masks: dict[int, torch.Tensor | None] = {}
        self._rows: torch.Tensor | None = None  # the decoding rows, when other sequences share the batch
        self._prepared = False  # the pool's decode attention describes this batch's decoding rows

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        if not self.others:
            return self._decode(layer, q, k, v)
        out = torch.empty_like(q)
        if self.decoding:
            if self._rows is None:
                rows = torch.tensor([self.bounds[i] for i in self.decoding])
                self._rows = rows.to(q.device, non_blocking=True)  # without waiting for the queued layers
            out[self._rows] = self._decode(layer, q[self._rows], k[self._rows], v[self._rows])
        for i in self.others:
            lo, hi = self.bounds[i], self.bounds[i + 1]
            out[lo:hi] = self._one(i, layer, q[lo:hi], k[lo:hi], v[lo:hi])
        return out

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The decoding sequences' rows q [B, Hq, D], k/v [B, Hkv, D] through the pool's paged decode
        attention: each row's new key and value stored at its slot, its pages read where they are."""
        if not self._prepared:
            describe_decode(self._decoders, torch.cat([self._slots[i] for i in self.decoding]))
            self._prepared = True
        return self._decoders[0].pool.decode(layer, q, k, v)

    def _one(self, i: int, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Sequence `i` alone: q [n, Hq, D] over its context and its k/v [n, Hkv, D]."""
        spec, keys, values, past = self.specs[i], k, v, 0
        context = spec.context
        if context is not None:
            past = context.length
            if spec.store:
                if i not in self._device_slots:
                    self._device_slots[i] = self._slots[i].to(k.device, non_blocking=True)
                slots = self._device_slots[i]
                for cache, new in ((context.pool.k_cache[layer], k), (context.pool.v_cache[layer], v)):
                    cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, new.to(cache.dtype))
            if past:
                keys, values = context.gather(layer, k, v)
        if i not in self._masks:
            mask = spec.mask(past, q.device)
            self._masks[i] = None if mask is None else _additive(mask, q.dtype)
        return _sdpa(q, keys, values, self._masks[i], self.scale)

    def commit(self, ropes: list[int]) -> None:
        """After the forward: each storing sequence's context takes its tokens; `ropes[i]` is its next position."""
        for spec, rope in zip(self.specs, ropes, strict=True):
            if spec.store and spec.context is not None:
                spec.context.commit(spec.num_tokens, rope)


def describe_decode(contexts: list[KVContext], slots: torch.Tensor, pad_to: int | None = None) -> None:
    """Describe to the pool's decode attention one new token per context (stored at `slots` [B], reserved)
    over its pages, the rows padded to `pad_to` (a captured graph's size)."""
    tables = torch.zeros((len(contexts), max(len(c.pages) for c in contexts)), dtype=torch.int32)
    for row, context in zip(tables, contexts, strict=True):
        row[: len(context.pages)] = torch.tensor(context.pages, dtype=torch.int32)
    contexts[0].pool.prepare_decode([c.length + 1 for c in contexts], slots, tables, pad_to=pad_to)


def _decodes(spec: QuerySpec) -> bool:
    """One stored token over a context of its own: it joins the batched decode call."""
    return spec.num_tokens == 1 and spec.store and spec.context is not None and not spec.context.view


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the additive one SDPA would make of it in every call (0 where True, -inf elsewhere),
    its rows 16-element aligned, else the memory-efficient kernel copies it in every call."""
    width = -(-mask.shape[-1] // 16) * 16
    out = torch.zeros((*mask.shape[:-1], width), dtype=dtype, device=mask.device)[..., : mask.shape[-1]]
    return out.masked_fill_(~mask, float("-inf"))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float) -> torch.Tensor:
    """One sequence: q [n, Hq, D] over k/v [m, Hkv, D] (GQA: each kv head serves Hq / Hkv query heads)."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    if mask is not None:  # the fused kernels that take a mask take no grouped heads: give each query head its own
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    # a batch of one: the fused kernels take only 4-D inputs (3-D ones fall back to the unfused math kernel)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale, enable_gqa=mask is None)
    return out[0].transpose(0, 1)
