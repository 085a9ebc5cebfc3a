"""Chunk policies and the consumer-side stream buffer."""

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
