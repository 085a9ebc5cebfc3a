"""Reading and writing whole KV pages of an attention backend, for sequences that move between engines.

Every paged backend (SDPA, Triton, FlashInfer) keeps one K and one V tensor of shape
[layers, pages, page_size, kv_heads, head_dim] indexed by page id (`PagedKVCache`); a sequence's pages
are gathered on the sender into [layers, n, page_size, kv_heads, head_dim] tensors and scattered into
the receiver's own page ids, which need not match the sender's.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class PagedKVCache(Protocol):
    """A backend whose cache is two [layers, pages, page_size, kv_heads, head_dim] tensors."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor


def _cache(attn: object) -> PagedKVCache:
    if not isinstance(attn, PagedKVCache):
        raise TypeError(f"{type(attn).__name__} keeps no paged k_cache/v_cache: its sequences cannot move")
    return attn


def gather_pages(attn: object, pages: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The K and V contents of `pages` (copies, on the backend's device); (None, None) for no pages."""
    if not pages:
        return None, None
    cache = _cache(attn)
    index = torch.tensor(pages, dtype=torch.long, device=cache.k_cache.device)
    return cache.k_cache.index_select(1, index), cache.v_cache.index_select(1, index)


def place_pages(attn: object, pages: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the K and V contents `k`, `v` ([layers, len(pages), ...]) into `pages` of the backend."""
    cache = _cache(attn)
    if k.shape[1] != len(pages) or k.shape[0] != cache.k_cache.shape[0] or k.shape[2:] != cache.k_cache.shape[2:]:
        raise ValueError(f"KV pages of shape {tuple(k.shape)} do not fit {len(pages)} pages of a cache "
                         f"shaped {tuple(cache.k_cache.shape)}")
    index = torch.tensor(pages, dtype=torch.long, device=cache.k_cache.device)
    with torch.inference_mode():
        cache.k_cache.index_copy_(1, index, k.to(cache.k_cache.device, cache.k_cache.dtype))
        cache.v_cache.index_copy_(1, index, v.to(cache.v_cache.device, cache.v_cache.dtype))
