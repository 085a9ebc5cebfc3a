"""A stream whose producer and consumer share a worker skips the transport, with the same results."""

from __future__ import annotations

import time
from collections import Counter

import torch

from mstar.runtime.offline import MStar
from mstar.transport.channels import InprocNetwork
from mstar.worker.worker import _scalar


def _run(config: str) -> tuple[dict, Counter, list[int]]:
    counts: Counter = Counter()
    original = InprocNetwork._deliver

    def counting(self, peer, msg):
        counts[type(msg).__name__] += 1
        return original(self, peer, msg)

    InprocNetwork._deliver = counting
    try:
        with MStar(config=config) as m:
            result = m.submit({"text": "The quick brown fox"}, max_tokens=40, stop_early=False).result()
            deadline = time.monotonic() + 5  # Release reaches the workers after the caller's finish event
            while any(w.state_size() for w in m.runtime.workers.values()) and time.monotonic() < deadline:
                time.sleep(0.01)
            sizes = [w.state_size() for w in m.runtime.workers.values()]
    finally:
        InprocNetwork._deliver = original
    return result.outputs, counts, sizes


def test_same_worker_stream_sends_no_messages_and_matches_two_workers():
    local, local_counts, local_sizes = _run("toy")
    remote, remote_counts, _ = _run("toy_2workers")
    assert local_counts["StreamItem"] == 0
    assert remote_counts["StreamItem"] > 40  # the prompt's last token and every generated one
    assert local_sizes == [0]  # nothing of the finished request is left, local stream items included
    assert local.keys() == remote.keys() and len(local["audio"]) == len(remote["audio"]) > 1
    torch.testing.assert_close(torch.cat(local["audio"]), torch.cat(remote["audio"]))
    assert [int(t) for t in local["text"]] == [int(t) for t in remote["text"]]


def test_scalar_ports_keep_value_and_dtype():
    for value in (0, 7, 28, 1 << 20, -3):
        t = _scalar(value)
        assert t.dtype == torch.int64 and t.shape == () and int(t) == value
    assert _scalar(True).dtype == torch.bool and bool(_scalar(True)) and not bool(_scalar(False))
    assert _scalar(1).dtype == torch.int64  # 1 and True are different cache entries
    assert _scalar(7) is _scalar(7)
