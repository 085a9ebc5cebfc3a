"""The continuous-batching scheduler's policy on CPU, step by step, with a real block pool and no model:
which sequences are admitted, which rows a tight token budget keeps, which sequence is preempted and how
it resumes, and which pages the prefix cache shares, keeps and evicts. Complements test_ar_scheduler.py."""

from __future__ import annotations

import itertools

from mstar.engines.autoregressive.batch_scheduler import BatchScheduler
from mstar.engines.autoregressive.sequence import SeqStatus, Sequence
from mstar.engines.autoregressive.token_inputs import TokenInputs
from mstar.engines.base import StepItem
from mstar.engines.kv_cache.block_pool import BlockPool
from mstar.engines.sampling import SamplingParams

PAGE = 4
_token_ids = itertools.count(1)


def fresh(n: int) -> list[int]:
    """`n` token ids no other call returns, so that sequences share a prefix only when a test says so."""
    return [next(_token_ids) for _ in range(n)]


def submit(scheduler: BatchScheduler, name: str, tokens: list[int]) -> Sequence:
    """A new sequence whose caller waits for a result, handed to the scheduler as the engine does."""
    seq = Sequence((name, "main"), SamplingParams(), list(tokens), len(tokens))
    seq.item = StepItem(name, "w", "n", {})
    scheduler.add(seq)
    return seq


def feed(scheduler: BatchScheduler, seq: Sequence, tokens: list[int]) -> None:
    """The caller's next item: more tokens, and a result awaited again."""
    seq.token_ids.extend(tokens)
    seq.item = StepItem(seq.key[0], "w", "n", {})
    scheduler.add(seq)


def step(scheduler: BatchScheduler) -> list[tuple[str, int, int]]:
    """Schedule and run one step: (name, start, tokens) of each chunk in batch order. A chunk that
    completes its sequence samples, so its caller has its result and no item is pending."""
    chunks = scheduler.schedule()
    scheduler.update(chunks)
    for chunk in chunks:
        if chunk.completes:
            chunk.seq.item = None
    return [(c.seq.key[0], c.start, c.num_tokens) for c in chunks]


def test_admission_is_first_come_and_stops_at_the_first_sequence_whose_pages_do_not_fit():
    pool = BlockPool(4, PAGE)
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    a = submit(scheduler, "a", fresh(12))  # 3 pages
    b = submit(scheduler, "b", fresh(8))  # 2 pages
    c = submit(scheduler, "c", fresh(2))  # 1 page: it would fit, but b is ahead of it
    assert step(scheduler) == [("a", 0, 12)]
    assert list(scheduler.waiting) == [b, c] and b.pages == [] and b.num_computed == 0
    assert pool.num_free == 1
    scheduler.add(b)  # a waiting sequence is queued once
    assert list(scheduler.waiting) == [b, c]
    scheduler.remove(c)  # its request was cancelled while it waited
    scheduler.remove(a)  # its request ended: its pages become cached, hence available
    assert list(scheduler.waiting) == [b] and pool.num_free == 4
    assert step(scheduler) == [("b", 0, 8)]
    assert scheduler.running == [b] and scheduler.num_preemptions == 0


def test_an_idle_sequence_keeps_its_seat_while_others_run_and_gives_it_up_when_nothing_can():
    scheduler = BatchScheduler(BlockPool(64, PAGE), max_num_seqs=2, max_batch_tokens=64)
    a, b = submit(scheduler, "a", fresh(3)), submit(scheduler, "b", fresh(3))
    assert step(scheduler) == [("a", 0, 3), ("b", 0, 3)]
    c = submit(scheduler, "c", fresh(3))
    feed(scheduler, a, fresh(1))
    assert step(scheduler) == [("a", 3, 1)]  # b waits for its caller but keeps its seat: c waits
    assert list(scheduler.waiting) == [c] and b.status is SeqStatus.RUNNING
    # nothing runs now: the newest idle sequence (b) is parked, freeing its seat and pages for c
    assert step(scheduler) == [("c", 0, 3)]
    assert b.status is SeqStatus.PARKED and b.pages == [] and b not in scheduler.waiting
    assert scheduler.running == [a, c] and scheduler.num_preemptions == 1
    feed(scheduler, b, fresh(1))
    assert b.status is SeqStatus.WAITING and list(scheduler.waiting) == [b]


def test_decode_rows_take_the_budget_before_an_older_sequence_s_prefill():
    scheduler = BatchScheduler(BlockPool(64, PAGE), max_num_seqs=8, max_batch_tokens=2)
    p, d1, d2 = (submit(scheduler, name, fresh(2)) for name in ("p", "d1", "d2"))
    # each two-token prompt fills the budget: one admission a step
    assert [step(scheduler) for _ in range(3)] == [[("p", 0, 2)], [("d1", 0, 2)], [("d2", 0, 2)]]
    feed(scheduler, p, fresh(5))  # p, admitted first, gets a longer second turn
    feed(scheduler, d1, fresh(1))
    feed(scheduler, d2, fresh(1))
    w = submit(scheduler, "w", fresh(2))
    assert step(scheduler) == [("d1", 2, 1), ("d2", 2, 1)]  # the budget is spent: p and w wait
    assert step(scheduler) == [("p", 2, 2)]
    assert p.item is not None  # a chunk that ends mid-prompt samples nothing
    assert step(scheduler) == [("p", 4, 2)]
    assert step(scheduler) == [("p", 6, 1), ("w", 0, 1)]  # the budget left over admits w's first chunk
    assert p.item is None and w.item is not None


def test_out_of_pages_the_newest_unscheduled_sequence_is_preempted_and_its_pages_go_to_the_others():
    pool = BlockPool(6, PAGE)
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    a, b, c = (submit(scheduler, name, fresh(8)) for name in "abc")
    assert step(scheduler) == [("a", 0, 8), ("b", 0, 8), ("c", 0, 8)] and pool.num_free == 0
    c_pages = list(c.pages)
    for seq in (a, b, c):
        feed(scheduler, seq, fresh(1))  # every ninth token opens a page
    assert step(scheduler) == [("a", 8, 1), ("b", 8, 1)]  # no admission right after a preemption
    assert c.status is SeqStatus.WAITING and list(scheduler.waiting) == [c] and scheduler.num_preemptions == 1
    assert c.pages == [] and c.num_computed == 0 and c.num_registered == 0
    # c's cached pages were evicted, its tail (freed first) before its head
    assert (a.pages[2], b.pages[2]) == (c_pages[1], c_pages[0]) and pool.num_cached_idle == 0
    scheduler.remove(a)
    assert step(scheduler) == [("c", 0, 9)]  # nothing of c was left in the cache: recomputed whole
    assert c.status is SeqStatus.RUNNING and len(c.pages) == 3


def test_the_step_that_preempts_admits_nothing_new():
    pool = BlockPool(5, PAGE)
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    a, idle = submit(scheduler, "a", fresh(4)), submit(scheduler, "idle", fresh(16))
    assert step(scheduler) == [("a", 0, 4), ("idle", 0, 16)] and pool.num_free == 0
    feed(scheduler, a, fresh(1))  # opens a page: the idle sequence gives up its four
    w = submit(scheduler, "w", fresh(2))
    assert step(scheduler) == [("a", 4, 1)]
    assert idle.status is SeqStatus.PARKED and pool.num_free == 3 and list(scheduler.waiting) == [w]
    assert step(scheduler) == [("w", 0, 2)]


def test_a_scheduled_row_is_never_preempted_so_an_older_prefill_preempts_itself_and_resumes_from_the_cache():
    pool = BlockPool(4, PAGE)
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    a, b = submit(scheduler, "a", fresh(8)), submit(scheduler, "b", fresh(7))
    assert step(scheduler) == [("a", 0, 8), ("b", 0, 7)] and pool.num_free == 0
    feed(scheduler, a, fresh(5))  # two more pages
    feed(scheduler, b, fresh(1))  # fits b's last page
    assert step(scheduler) == [("b", 7, 1)]  # b's decode row went first; a had nobody else to preempt
    assert a.status is SeqStatus.WAITING and list(scheduler.waiting) == [a] and a.pages == []
    assert pool.num_cached_idle == 2  # a's two full pages, still addressable
    # a's cached pages do not leave room for its rest; nothing else runs, so idle b gives up its pages
    assert step(scheduler) == [("a", 8, 5)]
    assert b.status is SeqStatus.PARKED and scheduler.running == [a] and scheduler.num_preemptions == 2


def test_a_running_sequence_s_full_pages_are_shared_by_a_request_with_the_same_prefix():
    pool = BlockPool(16, PAGE)
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    prompt = fresh(10)
    first = submit(scheduler, "first", prompt)
    assert step(scheduler) == [("first", 0, 10)]
    second = submit(scheduler, "second", prompt[:8] + fresh(3))
    assert step(scheduler) == [("second", 8, 3)]  # two pages taken from first, as they are
    assert second.pages[:2] == first.pages[:2] and second.pages[2] != first.pages[2]
    assert [pool.refcount(p) for p in second.pages] == [2, 2, 1] and pool.num_used == 4
    scheduler.remove(first)
    assert pool.num_used == 3 and pool.num_cached_idle == 0  # second still holds the shared pages
    scheduler.remove(second)
    assert pool.num_used == 0 and pool.num_cached_idle == 2  # the partial pages were never cached


def test_cached_pages_are_evicted_least_recently_freed_first_when_pages_are_needed():
    pool = BlockPool(5, PAGE)
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    x = submit(scheduler, "x", fresh(8))
    step(scheduler)
    x_tokens, x_pages = list(x.token_ids), list(x.pages)
    scheduler.remove(x)
    y = submit(scheduler, "y", fresh(8))
    step(scheduler)
    scheduler.remove(y)
    assert pool.num_cached_idle == 4 and pool.num_free == 5
    z = submit(scheduler, "z", fresh(8))
    assert step(scheduler) == [("z", 0, 8)]
    assert z.pages[1] == x_pages[1]  # after the one free page, x's tail: the least recently freed
    again = submit(scheduler, "x again", x_tokens + fresh(1))
    assert step(scheduler) == [("x again", 4, 5)]  # x's head is still a hit
    assert again.pages[0] == x_pages[0] and pool.num_cached_idle == 0  # y's pages went for the rest


def test_without_prefix_caching_a_repeated_prompt_is_computed_again():
    pool = BlockPool(16, PAGE, enable_prefix_caching=False)
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    prompt = fresh(10)
    first = submit(scheduler, "first", prompt)
    assert step(scheduler) == [("first", 0, 10)]
    scheduler.remove(first)
    assert pool.num_cached_idle == 0 and pool.num_free == 16
    submit(scheduler, "again", prompt + fresh(2))
    assert step(scheduler) == [("again", 0, 12)]


def test_only_tokens_that_depend_on_their_ids_alone_are_cached_or_taken_from_the_cache():
    pool = BlockPool(16, PAGE)
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    prompt = fresh(12)
    embedded = Sequence(("embedded", "main"), SamplingParams(), list(prompt), len(prompt))
    embedded.item, embedded.inputs = StepItem("embedded", "w", "n", {}), TokenInputs()
    embedded.inputs.num_shareable = 5  # an item's embeddings replace the ids from token 5 on
    scheduler.add(embedded)
    assert step(scheduler) == [("embedded", 0, 12)]
    assert embedded.num_registered == 1  # the page holding token 5 and those after it stay private
    scheduler.remove(embedded)
    assert pool.num_cached_idle == 1
    plain = submit(scheduler, "plain", prompt + fresh(1))
    assert step(scheduler) == [("plain", 4, 9)]
    assert plain.num_registered == 3  # the plain ids' pages are cached from here on


def test_grow_ahead_takes_free_pages_only_and_all_or_none():
    pool = BlockPool(4, PAGE)
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    a, b = submit(scheduler, "a", fresh(4)), submit(scheduler, "b", fresh(4))
    step(scheduler)
    assert scheduler.grow_ahead([a, b]) and (len(a.pages), len(b.pages), pool.num_free) == (2, 2, 0)
    assert not scheduler.grow_ahead([a])  # never by preempting
    assert len(a.pages) == 2 and scheduler.num_preemptions == 0 and scheduler.running == [a, b]
