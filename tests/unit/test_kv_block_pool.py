"""Block pool and prefix cache bookkeeping."""

import pytest

from mstar.engines.kv_cache.block_pool import BlockPool
from mstar.engines.kv_cache.prefix_cache import hash_page, hash_pages


def test_allocate_and_free_round_trip():
    pool = BlockPool(num_pages=4, page_size=2)
    pages = pool.allocate(3)
    assert len(set(pages)) == 3 and pool.num_free == 1
    assert all(pool.refcount(p) == 1 for p in pages)
    with pytest.raises(RuntimeError, match="only 1 available"):
        pool.allocate(2)
    pool.free(pages)
    assert pool.num_free == 4 and all(pool.refcount(p) == 0 for p in pages)


def test_double_free_is_caught():
    pool = BlockPool(num_pages=2, page_size=2)
    page = pool.allocate(1)
    pool.free(page)
    with pytest.raises(AssertionError):
        pool.free(page)


def test_chained_hash_depends_on_the_whole_prefix():
    a = hash_pages([1, 2, 3, 4, 5], page_size=2)
    b = hash_pages([9, 2, 3, 4], page_size=2)
    assert len(a) == 2 and len(b) == 2  # the partial page is not hashed
    assert a[0] != b[0] and a[1] != b[1]  # second pages hold equal tokens but different parents
    assert a[1] == hash_page(hash_page(None, [1, 2]), [3, 4])
    assert hash_pages([1, 2, 3, 4, 5, 6], 2, known=a) == hash_pages([1, 2, 3, 4, 5, 6], 2)


def test_prefix_match_shares_pages_and_counts_refs():
    pool = BlockPool(num_pages=6, page_size=2)
    hashes = hash_pages([1, 2, 3, 4, 5, 6], 2)
    pages = pool.allocate(3)
    for page, h in zip(pages, hashes):
        pool.register(page, h)
    other = hash_pages([1, 2, 3, 4, 7, 7], 2)
    shared = pool.match_prefix(other)
    assert shared == pages[:2]  # the run stops at the first miss
    assert pool.refcount(pages[0]) == 2 and pool.refcount(pages[2]) == 1


def test_idle_cached_pages_stay_reusable_until_evicted_lru():
    pool = BlockPool(num_pages=3, page_size=2)
    seq_a, seq_b = hash_pages([1, 1], 2), hash_pages([2, 2], 2)
    page_a, page_b = pool.allocate(1)[0], pool.allocate(1)[0]
    pool.register(page_a, seq_a[0])
    pool.register(page_b, seq_b[0])
    pool.free([page_a])
    pool.free([page_b])
    assert pool.num_free == 3  # idle cached pages count as available
    assert pool.match_prefix(seq_a) == [page_a]  # still a hit after its refcount reached 0
    pool.free([page_a])  # page_a is now the most recently used idle page
    taken = pool.allocate(2)  # free list first (1 page), then evict the LRU idle page: page_b
    assert page_b in taken and page_a not in taken
    assert pool.match_prefix(seq_b) == []  # evicted pages are forgotten
    assert pool.match_prefix(seq_a) == [page_a]


def test_duplicate_hash_keeps_the_first_page():
    pool = BlockPool(num_pages=2, page_size=2)
    h = hash_pages([5, 5], 2)[0]
    first, second = pool.allocate(2)
    pool.register(first, h)
    pool.register(second, h)
    pool.free([second])
    assert pool.num_free == 1 and pool.match_prefix([h]) == [first]
    pool.free([first, first])
    assert pool.num_free == 2


def test_prefix_caching_can_be_disabled():
    pool = BlockPool(num_pages=2, page_size=2, enable_prefix_caching=False)
    h = hash_pages([5, 5], 2)[0]
    page = pool.allocate(1)[0]
    pool.register(page, h)
    assert pool.match_prefix([h]) == []
