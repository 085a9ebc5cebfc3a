"""Pi0.5's paged prefix cache (#39): pages handed out and given back, a full cache refused with a clear
error, a batch's prefixes gathered back as written, and the policy component giving a request's pages
back when the request is released (a cancel) or its chunk is out."""

from __future__ import annotations

import pytest
import torch

from mstar.models.pi05.components import PolicyComponent
from mstar.models.pi05.prefix_kv import PoolFull, PrefixKVPool


def _pool(pages: int = 4) -> PrefixKVPool:
    return PrefixKVPool(layers=2, kv_heads=1, head_dim=3, num_pages=pages, page_size=4, dtype=torch.float32,
                        device="cpu")


def test_pages_are_allocated_and_given_back() -> None:
    pool = _pool()
    assert len(pool.allocate("a", 5).pages) == 2 and pool.free_pages == 2
    pool.allocate("b", 8)
    with pytest.raises(PoolFull, match="max_robots"):
        pool.allocate("c", 1)
    pool.release("a")
    pool.release("a")  # twice (a cancel after the last step) is harmless
    assert pool.free_pages == 2 and set(pool.allocate("c", 7).pages) == {1, 2}  # page 0 is the sink


def test_a_batch_reads_back_what_each_prefix_wrote() -> None:
    """Written through a page table of whole pages (padding to the sink, page 0), read back through
    another table of another order and width; the sink is never handed out."""
    pool = _pool(6)
    lengths = {"a": 6, "b": 3}
    for rid, n in lengths.items():
        pool.allocate(rid, n)
    keys = torch.randn(2, 12, 1, 3)  # three pages a row: a holds two, b one
    table = pool.page_table(["a", "b"], width=3)
    held = pool.held
    assert table.dtype == torch.long and table.tolist() == [[*held["a"].pages, 0, 6], [*held["b"].pages, 0, 0, 3]]
    pool.write(1, table, keys, -keys)
    view = pool.view(["b", "a"])
    got_k, got_v = view.layer(1)
    assert view.lengths.tolist() == [3, 6] and view.valid.sum(1).tolist() == [3, 6]
    torch.testing.assert_close(got_k[0, :3], keys[1, :3])
    torch.testing.assert_close(got_k[1, :6], keys[0, :6])
    torch.testing.assert_close(got_v[1, :6], -keys[0, :6])
    pool.release("a")
    pool.release("b")
    assert pool.free_pages == 6 and 0 not in {p for rid in "cdefgh" for p in pool.allocate(rid, 1).pages}


def test_the_policy_gives_pages_back_on_release() -> None:
    pool = _pool()
    component = PolicyComponent(torch.nn.Identity(), pool)  # the network is not reached
    pool.allocate("r1", 9)
    component.release("r1")
    assert pool.free_pages == 4 and "r1" not in pool.held
