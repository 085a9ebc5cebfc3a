"""Streams read inside loops, Fixed(first=), streams joined on another dim, per-component option scopes."""

import torch

from mstar.graph import Fixed, Loop, Node, Sequential
from mstar.worker.streams import END, StreamBuffer
from mstar.worker.walk_run import Outcome, WalkRun
from mstar.worker.worker import scoped_options


def test_fixed_with_a_larger_first_chunk():
    policy = Fixed(1, first=2)
    assert policy.next_chunk(0, 1, False) is None
    assert policy.next_chunk(0, 2, False) == (0, 2, 2)
    assert policy.next_chunk(2, 3, False) == (2, 3, 3)
    assert policy.next_chunk(0, 1, True) == (0, 1, 1)  # a short stream is flushed whole


def test_stream_buffer_joins_items_along_its_dim():
    buf = StreamBuffer(Fixed(1, first=2), dim=1)
    buf.put(1, torch.ones(2, 1, 3))
    assert buf.pop() is None
    buf.put(0, torch.zeros(2, 4, 3))
    chunk = buf.pop()
    assert chunk.value.shape == (2, 5, 3) and chunk.new == 2 and bool(chunk.value[:, 4].eq(1).all())
    buf.end(2)
    assert buf.pop() is END


def test_a_stream_node_in_a_loop_takes_one_chunk_per_iteration():
    body = Sequential(Node("reader", inputs=("states", "count"), outputs=("count",)), Node("other", inputs=("count",)))
    run = WalkRun(Loop(body, max_iterations=3), {}, {"count": torch.tensor(0)}, frozenset({"states"}),
                  lambda e, v: None)
    calls = run.start()
    for i in range(3):
        (call,) = calls
        assert call.node.name == "reader" and call.per_iteration and call.stream == ("states", "states")
        (other,) = run.complete("reader", Outcome({"count": call.inputs["count"] + 1}))
        assert int(other.inputs["count"]) == i + 1  # the reader ran once, then the rest of the body
        calls = run.complete("other", Outcome())
    assert run.done and calls == []


def test_scoped_options_keep_plain_keys_and_their_own_namespace_only():
    opts = {"modalities": ["audio"], "thinker.temperature": 0.5, "talker.temperature": 0.9, "talker.top_k": 50}
    assert scoped_options(opts, "talker") == {"modalities": ["audio"], "temperature": 0.9, "top_k": 50}
    assert scoped_options(opts, "thinker") == {"modalities": ["audio"], "temperature": 0.5}
