"""The paged KV pool a stateless component keeps contexts of its own in (`KVPoolSpec`, engines/base.py).

Pages come from a `BlockPool` (no prefix cache: the component shares pages itself, by reference count)
and live in the caches of an attention backend made as the autoregressive engine makes its own
(`kv_cache.attention_backend` names: on CUDA the Triton backend, on CPU the SDPA reference). Decode rows
attend through that backend, which reads each row's pages in place; the component reads and writes the
caches by page for everything else.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.engines.attention.base import AttentionMetadata, GraphedAttention, PagedCacheAttention
from mstar.engines.base import KVPoolSpec
from mstar.engines.kv_cache.block_pool import BlockPool


class PagedKV:
    """A `PagedKVStore` of `spec.num_pages` pages on `device`."""

    def __init__(self, spec: KVPoolSpec, device: torch.device | str) -> None:
        from mstar.engines.autoregressive.runner import make_attention_backend

        self.spec, self.page_size = spec, spec.page_size
        self.blocks = BlockPool(spec.num_pages, spec.page_size, enable_prefix_caching=False)
        backend = make_attention_backend(spec.attention_backend, spec.layout, spec.num_pages, spec.page_size,
                                         torch.device(device), max_num_seqs=spec.max_rows)
        if not isinstance(backend, PagedCacheAttention):
            raise TypeError(f"attention backend {type(backend).__name__} keeps no page-addressed k_cache/v_cache")
        self.attention: PagedCacheAttention = backend
        self.k_cache, self.v_cache = backend.k_cache, backend.v_cache
        self.graphed = isinstance(backend, GraphedAttention) and torch.device(device).type == "cuda"

    @property
    def num_free(self) -> int:
        return self.blocks.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.blocks.num_free:
            raise RuntimeError(f"KV pool full: {n} pages asked, {self.blocks.num_free} of {self.spec.num_pages} "
                               f"free ({self.page_size} tokens each); raise {self.spec.setting} or lower the "
                               "requests in flight")
        return self.blocks.allocate(n)

    def share(self, pages: Sequence[int]) -> None:
        self.blocks.share(pages)

    def free(self, pages: Sequence[int]) -> None:
        self.blocks.free(pages)

    def prepare_decode(self, seq_lens: list[int], slots: torch.Tensor, block_tables: torch.Tensor,
                       pad_to: int | None = None) -> None:
        meta = AttentionMetadata([1] * len(seq_lens), seq_lens, slots, block_tables)
        if pad_to is None:
            self.attention.prepare(meta)
            return
        if not isinstance(self.attention, GraphedAttention):
            raise ValueError(f"{type(self.attention).__name__} pads no decode batch (pad_to={pad_to})")
        self.attention.prepare(meta, pad_to=pad_to)

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attention.forward(layer, q, k, v)
