"""The continuous-batching scheduler on CPU, with a real block pool and sequences but no model: admission,
the chunk budget, preemption and prefix hits."""

from __future__ import annotations

from mstar.engines.autoregressive.batch_scheduler import BatchScheduler
from mstar.engines.autoregressive.sequence import SeqStatus, Sequence
from mstar.engines.autoregressive.token_inputs import TokenInputs
from mstar.engines.base import StepItem
from mstar.engines.kv_cache.block_pool import BlockPool
from mstar.engines.kv_handoff import KVPositions
from mstar.engines.sampling import SamplingParams

PAGE = 4


def seq(name: str, tokens, waiting_item: bool = True, shared: bool = False) -> Sequence:
    """A new sequence of `tokens`, offset by its name so that different names share no prefix unless
    `shared`; with `waiting_item` its caller waits for a result (as an item does)."""
    base = 0 if shared else 1000 * (sum(map(ord, name)) % 97)
    s = Sequence((name, "main"), SamplingParams(), [base + t for t in tokens], len(tokens))
    s.item = StepItem(name, "w", "n", {}) if waiting_item else None
    return s


def step(scheduler: BatchScheduler) -> dict[str, tuple[int, int]]:
    """Schedule and run one step (the model is not needed): name -> (start, tokens) of its chunk."""
    chunks = scheduler.schedule()
    scheduler.update(chunks)
    return {c.seq.key[0]: (c.start, c.num_tokens) for c in chunks}


def decode(s: Sequence, token: int = 7) -> None:
    """The caller feeds the sampled token back, as the next item does."""
    s.token_ids.append(token)


def test_decodes_go_first_then_prefill_chunks_within_the_token_budget():
    scheduler = BatchScheduler(BlockPool(64, PAGE), max_num_seqs=8, max_batch_tokens=16)
    a, b = seq("a", range(5)), seq("b", range(3))
    for s in (a, b):
        scheduler.add(s)
    assert step(scheduler) == {"a": (0, 5), "b": (0, 3)}  # both prompts fit one step
    long = seq("long", range(40))
    scheduler.add(long)
    decode(a)
    decode(b)
    assert step(scheduler) == {"a": (5, 1), "b": (3, 1), "long": (0, 14)}  # 16 tokens: two decodes, 14 of the prompt
    decode(a)
    assert step(scheduler) == {"a": (6, 1), "long": (14, 15)}  # b's caller has not fed a token: b idles
    assert step(scheduler) == {"long": (29, 11)}  # the rest of the prompt
    assert all(s.status is SeqStatus.RUNNING for s in (a, b, long))


def test_no_more_than_max_num_seqs_run():
    scheduler = BatchScheduler(BlockPool(64, PAGE), max_num_seqs=2, max_batch_tokens=64)
    seqs = [seq(str(i), range(3)) for i in range(3)]
    for s in seqs:
        scheduler.add(s)
    assert set(step(scheduler)) == {"0", "1"}
    assert seqs[2].status is SeqStatus.WAITING and list(scheduler.waiting) == [seqs[2]]
    scheduler.remove(seqs[0])  # its request ended
    assert set(step(scheduler)) == {"2"}


def test_out_of_pages_the_newest_running_sequence_is_preempted_and_recomputes_later():
    pool = BlockPool(4, PAGE)  # 16 tokens in all
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    old, new = seq("old", range(8)), seq("new", range(8))
    for s in (old, new):
        scheduler.add(s)
    assert step(scheduler) == {"old": (0, 8), "new": (0, 8)} and pool.num_free == 0
    decode(old)
    decode(new)
    assert step(scheduler) == {"old": (8, 1)}  # old's ninth token opens a page: new gives up its two
    assert new.status is SeqStatus.WAITING and new.pages == [] and scheduler.num_preemptions == 1
    assert scheduler.waiting[0] is new
    scheduler.remove(old)
    # recomputed: its head page stayed in the prefix cache (old's page came from its tail), the rest runs again
    assert step(scheduler) == {"new": (4, 5)}


def test_a_preempted_idle_sequence_is_parked_until_its_next_item():
    pool = BlockPool(2, PAGE)
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    idle = seq("idle", range(8), waiting_item=False)  # its caller holds the next token back (another branch)
    scheduler.add(idle)
    step(scheduler)
    other = seq("other", range(6))
    scheduler.add(other)
    # nothing else can run: the idle sequence gives up its pages so the new one makes progress
    assert step(scheduler) == {"other": (0, 6)}
    assert idle.status is SeqStatus.PARKED and idle not in scheduler.waiting
    scheduler.add(idle)  # its next item came
    assert idle.status is SeqStatus.WAITING and scheduler.waiting[-1] is idle


def test_a_shared_prefix_is_taken_from_the_cache_and_at_least_one_token_computed():
    pool = BlockPool(16, PAGE)
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    prompt = list(range(100, 110))  # two full pages and two tokens
    first = seq("first", prompt, shared=True)
    scheduler.add(first)
    step(scheduler)
    scheduler.remove(first)  # its full pages stay cached
    again = seq("again", prompt + [1, 2], shared=True)
    scheduler.add(again)
    assert step(scheduler) == {"again": (8, 4)}  # two cached pages: 8 tokens not computed again
    same = seq("same", prompt[:8], shared=True)  # exactly the cached pages: the last page is recomputed for logits
    scheduler.add(same)
    assert step(scheduler) == {"same": (4, 4)}


def moved(name: str, tokens, waiting_item: bool = True) -> Sequence:
    """A sequence moved here with every token computed elsewhere, whose K/V depend on more than their ids
    (as a prompt with media rows): it cannot be recomputed here."""
    s = seq(name, tokens, waiting_item)
    s.inputs = TokenInputs.resumed(KVPositions(len(s.token_ids), 0.0, False, False, num_shareable=0))
    s.num_moved = len(s.token_ids)
    return s


def test_out_of_pages_a_sequence_that_cannot_recompute_is_passed_over_for_one_that_can():
    pool = BlockPool(4, PAGE)
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    old, new = seq("old", range(8)), moved("new", range(8))
    for s in (old, new):
        scheduler.add(s)
    assert step(scheduler) == {"old": (0, 8), "new": (0, 8)} and pool.num_free == 0
    decode(old)
    decode(new)
    # old's ninth token opens a page: new is the newest, but old gives its own two up instead
    assert step(scheduler) == {"new": (8, 1)}
    assert old.status is SeqStatus.WAITING and new.status is SeqStatus.RUNNING and not scheduler.dropped
    assert scheduler.num_preemptions == 1


def test_a_sequence_that_cannot_recompute_is_dropped_when_it_is_the_only_victim():
    pool = BlockPool(3, PAGE)
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    only = moved("only", range(12))
    scheduler.add(only)
    step(scheduler)
    decode(only)
    assert step(scheduler) == {} and scheduler.dropped == [only]  # its 13th token found no page
    assert only.pages == [] and pool.num_free == 3 and scheduler.num_preemptions == 0
    assert only not in scheduler.running and only not in scheduler.waiting


def test_an_idle_sequence_that_cannot_recompute_gives_its_seat_up_only_when_no_other_can():
    pool = BlockPool(4, PAGE)
    scheduler = BatchScheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    plain, held = seq("plain", range(8), waiting_item=False), moved("held", range(8), waiting_item=False)
    for s in (plain, held):
        scheduler.add(s)
    step(scheduler)
    new = seq("new", range(8))
    scheduler.add(new)
    # the progress guarantee: an idle sequence gives its pages up; the older plain one, not the newest
    assert step(scheduler) == {"new": (0, 8)}
    assert plain.status is SeqStatus.PARKED and held.status is SeqStatus.RUNNING and not scheduler.dropped
    scheduler.remove(new)  # its request ended
    scheduler.add(seq("big", range(16)))
    assert step(scheduler) == {"big": (0, 16)}  # only the moved one idles: it is dropped, not parked to recompute
    assert scheduler.dropped == [held] and held.pages == [] and held not in scheduler.waiting
