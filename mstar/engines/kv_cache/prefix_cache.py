"""Prefix cache: full KV pages addressed by a chained hash of their token ids.

A page's hash covers its own tokens and, through the parent hash, every token before it, so equal
hashes mean equal prefixes (up to a 128-bit hash collision) and the page's KV can be reused as is.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


def hash_page(parent: int | None, tokens: Sequence[int]) -> int:
    """Chained hash of one full page: hash(parent_hash, tokens). A cryptographic digest keeps
    accidental collisions (which would silently change outputs) out of reach."""
    h = hashlib.blake2b(digest_size=16)
    h.update((parent if parent is not None else 0).to_bytes(16, "little"))
    h.update(b"\x01" if parent is not None else b"\x00")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def hash_pages(token_ids: Sequence[int], page_size: int, known: Sequence[int] = ()) -> list[int]:
    """Hashes of every full page of `token_ids`, reusing the already computed prefix `known`."""
    hashes = list(known)
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * page_size, len(token_ids) - page_size + 1, page_size):
        parent = hash_page(parent, token_ids[start : start + page_size])
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Maps page hashes to pages and keeps unreferenced cached pages in LRU order for eviction.

    Pure bookkeeping: the block pool tells it when a cached page becomes idle (refcount 0) or
    used again; it never owns page memory.
    """

    def __init__(self) -> None:
        self._page_by_hash: dict[int, int] = {}
        self._hash_by_page: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def lookup(self, page_hash: int) -> int | None:
        """The page holding this hash's KV, or None."""
        return self._page_by_hash.get(page_hash)

    def insert(self, page: int, page_hash: int) -> bool:
        """Record that `page` holds `page_hash`; False (nothing recorded) if the hash or page is taken."""
        if page_hash in self._page_by_hash or page in self._hash_by_page:
            return False
        self._page_by_hash[page_hash] = page
        self._hash_by_page[page] = page_hash
        return True

    def is_cached(self, page: int) -> bool:
        """Whether `page` is addressable by a hash."""
        return page in self._hash_by_page

    def park(self, page: int) -> None:
        """A cached page lost its last user: keep it reusable, most recently used last."""
        self._idle[page] = None

    def unpark(self, page: int) -> None:
        """An idle cached page is in use again."""
        self._idle.pop(page, None)

    @property
    def num_idle(self) -> int:
        """Cached pages nobody uses (evictable)."""
        return len(self._idle)

    def evict(self) -> int:
        """Forget the least recently used idle page and return it for reuse."""
        page, _ = self._idle.popitem(last=False)
        del self._page_by_hash[self._hash_by_page.pop(page)]
        return page
