"""Moving a computed sequence between engines (`KVHandoff`): the receiver holds what its prefix cache
has of the prompt, the sender exports the sequence's other pages, the receiver adopts them.

Every paged backend (SDPA, Triton, FlashInfer) keeps one K and one V tensor of shape
[layers, pages, page_size, kv_heads, head_dim] indexed by page id (`PagedKVCache`); a sequence's pages
are gathered on the sender into [layers, n, page_size, kv_heads, head_dim] tensors and scattered into
the receiver's own page ids, which need not match the sender's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from mstar.engines.kv_cache.prefix_cache import hash_pages
from mstar.engines.kv_handoff import KVExport

if TYPE_CHECKING:
    from mstar.engines.autoregressive.batch_scheduler import BatchScheduler
    from mstar.engines.autoregressive.sequence import Sequence
    from mstar.engines.kv_cache.block_pool import BlockPool


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


def hold_cached_prefix(pool: BlockPool, prompt: list[int]) -> tuple[list[int], list[int]]:
    """The pages `pool`'s prefix cache has of the leading full pages of `prompt`, each now referenced
    (the caller frees them), and their hashes."""
    page = pool.page_size
    hashes = hash_pages(prompt[: len(prompt) // page * page], page, [])
    pages = pool.match_prefix(hashes)
    return pages, hashes[: len(pages)]


def exportable(seq: Sequence) -> bool:
    """Whether `seq` can move: every token computed and no item pending."""
    return seq.item is None and bool(seq.token_ids) and seq.num_computed == len(seq.token_ids)


def export_sequence(seq: Sequence, pool: BlockPool, attn: object, held: list[int]) -> tuple[KVExport, int]:
    """`seq` as a `KVExport` whose K/V skips the leading pages whose hashes match `held` (the receiver
    has them), and the number of pages sent; `seq` itself is left to the caller to drop."""
    hashes = seq.page_hashes[: seq.num_registered]
    skip = 0
    while skip < min(len(held), len(hashes)) and held[skip] == hashes[skip]:
        skip += 1
    pages = seq.pages[skip : pool.pages_for(seq.num_computed)]
    k, v = gather_pages(attn, pages)
    positions = seq.inputs.continuation() if seq.inputs is not None else None
    return KVExport(list(seq.token_ids), list(hashes), skip, k, v, positions), len(pages)


def adopt_pages(seq: Sequence, export: KVExport, held: list[int], pool: BlockPool, sched: BatchScheduler,
                attn: object) -> int | None:
    """Give a new sequence (not yet queued) the pages of `export`: the held ones it skipped (their
    references leave `held`; the caller frees the rest), fresh ones with the sent contents; it joins
    `sched`'s running sequences with its tokens computed. The number of fresh pages, or None when there
    is no room (too few free pages or seats, or fewer held pages than skipped): nothing changed then."""
    fresh = pool.pages_for(len(export.tokens)) - export.skip
    if export.skip > len(held) or fresh > pool.num_free or len(sched.running) >= sched.max_num_seqs:
        return None
    seq.pages = [*held[: export.skip], *pool.allocate(fresh)]
    del held[: export.skip]
    if fresh:
        assert export.k is not None and export.v is not None
        place_pages(attn, seq.pages[export.skip :], export.k, export.v)
    seq.num_computed = len(export.tokens)
    seq.page_hashes = list(export.page_hashes)
    for i in range(export.skip, len(export.page_hashes)):
        pool.register(seq.pages[i], export.page_hashes[i])
    seq.num_registered = len(export.page_hashes)
    sched.adopt(seq)
    return fresh
