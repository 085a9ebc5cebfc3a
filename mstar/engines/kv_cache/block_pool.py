"""A fixed pool of KV pages with reference counts, a free list and prefix reuse."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from mstar.engines.kv_cache.prefix_cache import PrefixCache


class BlockPool:
    """Hands out page ids in [0, num_pages); pure CPU bookkeeping, no tensors.

    A page is free (on the free list), in use (refcount > 0, possibly shared through the prefix
    cache) or idle-cached (refcount 0 but still addressable by hash). Idle-cached pages count as
    available: `allocate` evicts them, least recently used first, once the free list is empty.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"BlockPool needs num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_pages))
        self._refcount = [0] * num_pages
        self._cache = PrefixCache()

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out now (free plus evictable)."""
        return len(self._free) + self._cache.num_idle

    @property
    def num_used(self) -> int:
        """Pages held by at least one sequence (refcount > 0)."""
        return self.num_pages - self.num_free

    @property
    def num_cached_idle(self) -> int:
        """Pages nobody holds that the prefix cache keeps for reuse (evicted on demand)."""
        return self._cache.num_idle

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages (refcount 1 each); raises if fewer than `n` are available."""
        if n > self.num_free:
            raise RuntimeError(f"BlockPool: asked for {n} pages, only {self.num_free} available")
        pages = []
        for _ in range(n):
            page = self._free.popleft() if self._free else self._cache.evict()
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; cached pages stay reusable until evicted."""
        # Reversed, so that a sequence's tail pages are evicted before its head: heads are the
        # most widely shared prefixes.
        for page in reversed(pages):
            assert self._refcount[page] > 0, f"page {page} freed twice"
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if self._cache.is_cached(page):
                    self._cache.park(page)
                else:
                    self._free.append(page)

    def share(self, pages: Sequence[int]) -> None:
        """One more reference to each of `pages`, all in use (a second holder of them: a prefix of one
        sequence's pages read by another)."""
        for page in pages:
            assert self._refcount[page] > 0, f"page {page} shared while not in use"
            self._refcount[page] += 1

    def match_prefix(self, page_hashes: Sequence[int]) -> list[int]:
        """Take a reference to the cached pages of the longest cached run of `page_hashes`."""
        pages: list[int] = []
        if not self.enable_prefix_caching:
            return pages
        for page_hash in page_hashes:
            page = self._cache.lookup(page_hash)
            if page is None:
                break
            if self._refcount[page] == 0:
                self._cache.unpark(page)
            self._refcount[page] += 1
            pages.append(page)
        return pages

    def register(self, page: int, page_hash: int) -> None:
        """Make a full, computed page (in use) findable by its hash; a hash already cached is kept."""
        assert self._refcount[page] > 0, f"page {page} registered while not in use"
        if self.enable_prefix_caching:
            self._cache.insert(page, page_hash)

    def refcount(self, page: int) -> int:
        """Current number of users of `page`."""
        return self._refcount[page]
