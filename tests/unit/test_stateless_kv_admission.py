"""The stateless engine admits requests to a component's paged KV pool: each is promised the pages it will
hold at most when its first page-taking item runs; one that does not fit what is unpromised waits (no later
request overtakes it), one larger than the whole pool fails alone, and a release gives the promise back."""

from __future__ import annotations

import torch

from mstar.engines.base import KVLayout, KVPoolSpec, PagedKVStore, StatelessBase, StatelessSpec, StepItem
from mstar.engines.stateless import StatelessEngine

PAGES = 8


class _Contexts(StatelessBase, torch.nn.Module):
    """Walk `open` takes the pages its option `pages` asks for (all of them at once: the most it will hold);
    walk `step` takes none. Records the request ids of every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.pool: PagedKVStore | None = None
        self.held: dict[str, list[int]] = {}
        self.batches: list[list[str]] = []

    def set_kv_pool(self, pool: PagedKVStore) -> None:
        self.pool = pool

    def kv_pages(self, item: StepItem) -> int:
        return int(item.options["pages"]) if item.walk == "open" else 0

    def run_items(self, items: list[StepItem]) -> list[dict]:
        self.batches.append([i.request_id for i in items])
        for i in items:
            if i.walk == "open":
                self.held[i.request_id] = self.pool.allocate(int(i.options["pages"]))  # raises when the pool is full
        return [{} for _ in items]

    def batch_key(self, item: StepItem) -> str:
        return item.walk

    def release(self, request_id: str) -> None:
        self.pool.free(self.held.pop(request_id, []))


def _engine() -> tuple[StatelessEngine, _Contexts]:
    module = _Contexts()
    spec = KVPoolSpec(KVLayout(1, 1, 8, torch.float32), PAGES, "model_kwargs.kv_tokens", page_size=4, max_rows=4)
    return StatelessEngine(module, StatelessSpec(max_batch_size=8, kv_pool=spec)), module


def _open(rid: str, pages: int) -> StepItem:
    return StepItem(rid, "open", "n", {}, {"pages": pages})


def _step(rid: str) -> StepItem:
    return StepItem(rid, "step", "n", {}, {})


def test_a_request_waits_for_pages_and_runs_once_they_are_released():
    engine, module = _engine()
    for rid, pages in (("a", 5), ("b", 3), ("c", 2), ("d", 1)):
        engine.submit(_open(rid, pages))
    results = engine.step()
    assert [r.request_id for r in results] == ["a", "b"] and not any(r.error for r in results)
    # c and d find no pages unpromised; nothing else to run: the engine waits for a submit or a release
    assert engine.step() == [] and not engine.has_work() and engine.stats()["seqs_waiting"] == 2
    assert engine.stats()["kv_pages_used"] == PAGES
    engine.submit(_step("a"))  # an admitted request's items run while others wait for pages
    assert [r.request_id for r in engine.step()] == ["a"]
    engine.release("b")
    results = engine.step()
    assert [r.request_id for r in results] == ["c", "d"] and not any(r.error for r in results)
    engine.release("a")
    engine.release("c")
    engine.release("d")
    assert engine.stats()["kv_pages_used"] == 0 and not engine.has_work()


def test_a_waiting_request_is_not_overtaken_by_smaller_ones():
    engine, module = _engine()
    engine.submit(_open("a", 5))
    engine.step()
    engine.submit(_open("big", 4))  # 3 pages unpromised: waits
    engine.submit(_open("small", 1))  # would fit, but arrived after big
    assert engine.step() == [] and module.batches == [["a"]]
    engine.release("a")
    assert [r.request_id for r in engine.step()] == ["big", "small"]


def test_a_request_larger_than_the_pool_fails_alone():
    engine, module = _engine()
    engine.submit(_open("a", 2))
    engine.submit(_open("huge", PAGES + 1))
    engine.submit(_open("b", 2))
    results = {r.request_id: r for r in engine.step()}
    assert results["huge"].error is not None and "model_kwargs.kv_tokens" in results["huge"].error
    assert "9 pages" in results["huge"].error and results["a"].error is None and results["b"].error is None
    assert module.batches == [["a", "b"]] and "huge" not in module.held
