"""Chunk policies and the consumer-side stream buffer."""

import pytest
import torch

from mstar.graph import Fixed, LeftContext, SlidingWindow
from mstar.worker.streams import END, StreamBuffer


def drain(policy, n, end_after=True):
    buf = StreamBuffer(policy)
    for i in range(n):
        buf.put(i, torch.tensor([i]))
    chunks = []
    while (c := buf.pop()) not in (None, END):
        chunks.append((c.value.tolist(), c.new, c.final))
    if end_after:
        buf.end(n)
        while (c := buf.pop()) not in (None, END):
            chunks.append((c.value.tolist(), c.new, c.final))
        assert buf.pop() is END
    return chunks


def test_fixed_flushes_remainder():
    assert drain(Fixed(3), 7) == [([0, 1, 2], 3, False), ([3, 4, 5], 3, False), ([6], 1, True)]


def test_sliding_window_covers_every_item_once_as_new():
    chunks = drain(SlidingWindow(4, 2), 9)
    assert chunks[0] == ([0, 1, 2, 3], 4, False)
    assert chunks[1] == ([2, 3, 4, 5], 2, False)
    assert sum(new for _, new, _ in chunks) == 9
    assert chunks[-1][0][-1] == 8 and chunks[-1][2]


def test_sliding_window_short_stream_flushes_whole():
    assert drain(SlidingWindow(28, 7), 5) == [([0, 1, 2, 3, 4], 5, True)]


def test_left_context_first_chunk_has_no_context():
    chunks = drain(LeftContext(chunk=2, context=1), 5)
    assert chunks == [([0, 1], 2, False), ([1, 2, 3], 2, False), ([3, 4], 1, True)]


def test_out_of_order_items_wait_for_the_gap():
    buf = StreamBuffer(Fixed(2))
    buf.put(1, torch.tensor([1]))
    assert buf.pop() is None
    buf.put(0, torch.tensor([0]))
    assert buf.pop().value.tolist() == [0, 1]


def test_empty_stream_ends_immediately():
    buf = StreamBuffer(SlidingWindow(4, 2))
    buf.end(0)
    assert buf.pop() is END


def test_sliding_window_recut_at_end_repeats_the_last_window_once():
    plain = drain(SlidingWindow(4, 2), 8)
    assert plain[-1][:2] == ([4, 5, 6, 7], 2)  # covers 6, 7: nothing left, no more chunks
    recut = drain(SlidingWindow(4, 2, recut_at_end=True), 8)
    assert recut[:-1] == [(v, n, False) for v, n, _ in plain]
    assert recut[-1] == ([4, 5, 6, 7], 0, True)
    # a tail not yet covered is flushed as usual (once, not twice)
    assert drain(SlidingWindow(4, 2, recut_at_end=True), 9)[-1] == ([5, 6, 7, 8], 1, True)
    assert drain(SlidingWindow(28, 7, recut_at_end=True), 5) == [([0, 1, 2, 3, 4], 5, True)]


def test_stream_filter_drops_in_order_and_the_stream_still_ends():
    buf = StreamBuffer(Fixed(2), accept=lambda item, accepted: int(item) % 3 != 0 or accepted == 0)
    for i in (2, 1, 0, 3, 4):  # out of order: filtering happens in stream order
        buf.put(i, torch.tensor([i]))
    buf.end(5)
    chunks = []
    while (c := buf.pop()) is not END:
        chunks.append((c.value.tolist(), c.start, c.final))
    # 0 kept (first), 1, 2 kept, 3 dropped, 4 kept
    assert chunks == [([0, 1], 0, False), ([2, 4], 2, True)]


def test_sliding_window_early_window_then_full_windows():
    buf = StreamBuffer(SlidingWindow(4, 2, recut_at_end=True, first=2))
    chunks = []
    for i in range(7):
        buf.put(i, torch.tensor([i]))
        while (c := buf.pop()) not in (None, END):
            chunks.append((c.value.tolist(), c.new, c.final))
    buf.end(7)
    while (c := buf.pop()) not in (None, END):
        chunks.append((c.value.tolist(), c.new, c.final))
    assert chunks == [([0, 1], 2, False), ([0, 1, 2, 3], 2, False), ([2, 3, 4, 5], 2, False),
                      ([3, 4, 5, 6], 1, True)]
    # an ended stream gets no early window; a short one after its early window is flushed whole
    assert drain(SlidingWindow(4, 2, first=2), 3, end_after=True)[0] == ([0, 1], 2, False)
    ended = StreamBuffer(SlidingWindow(4, 2, first=2))
    for i in range(3):
        ended.put(i, torch.tensor([i]))
    ended.end(3)
    assert ended.pop().value.tolist() == [0, 1, 2]


def test_sliding_window_first_must_be_shorter_than_the_window():
    import pytest

    with pytest.raises(ValueError, match="first"):
        SlidingWindow(4, 2, first=4)


def test_stream_filter_sees_items_in_stream_order_whatever_the_arrival_order():
    """In-order items take a direct path, held-back ones wait for the gap: the filter sees the same
    items with the same kept counts either way (multiples of 3 stay only at an even kept count)."""
    def kept(order):
        calls = []

        def keep(item, n):
            calls.append((int(item), n))
            return int(item) % 3 != 0 or n % 2 == 0

        buf = StreamBuffer(Fixed(100), accept=keep)
        for seq in order:
            buf.put(seq, torch.tensor([seq]))
        buf.end(len(order))
        return calls, buf.pop().value.tolist()

    in_order = kept(list(range(12)))
    assert in_order == kept([1, 0, 2, 5, 3, 4, 6, 7, 11, 10, 9, 8]) == kept(list(reversed(range(12))))
    assert in_order[1] == [0, 1, 2, 4, 5, 7, 8, 10, 11]


@pytest.mark.parametrize("policy", [Fixed(3), Fixed(1, first=2), SlidingWindow(28, 7), SlidingWindow(4, 2, first=3),
                                    SlidingWindow(28, 7, recut_at_end=True, first=14), LeftContext(3, 2)])
def test_waits_for_is_the_least_count_that_cuts_an_open_stream(policy):
    """Every cursor a policy reaches: below `waits_for(start)` items no chunk, at it one (the worker feeds
    a stream's consumer only from there on)."""
    start, cursors = 0, []
    for _ in range(12):  # walk the cursors chunk after chunk
        cursors.append(start)
        need = policy.waits_for(start)
        assert all(policy.next_chunk(start, n, False) is None for n in range(max(start, 0), need))
        cut = policy.next_chunk(start, need, False)
        assert cut is not None
        start = cut[2]
    assert len(set(cursors)) > 5


def test_buffer_ready_follows_the_policy_and_the_end():
    buf = StreamBuffer(SlidingWindow(4, 2, first=3), accept=lambda item, accepted: int(item) != 0)
    readiness = []
    for i in range(8):
        buf.put(i, torch.tensor([i]))  # item 0 is dropped by the filter
        readiness.append(buf.ready())
        if buf.ready():
            assert buf.pop() is not None
    assert readiness == [False, False, False, True, True, False, True, False]
    buf.end(8)
    assert buf.ready()  # an ended stream may always have a last chunk or END
