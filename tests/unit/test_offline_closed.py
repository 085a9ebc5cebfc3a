"""The offline API and `close()`: a request open at close ends with an error, a later one is refused at
once; neither is left waiting on stopped workers."""

import threading

import pytest

from mstar.conductor.conductor import AdmissionError
from mstar.runtime.offline import MStar, RequestFailed


def test_a_closed_mstar_refuses_requests_at_once():
    m = MStar("toy")
    assert m.generate({"text": "hi"}, max_tokens=2).finish_reason == "length"
    m.close()
    with pytest.raises(AdmissionError, match="shut down"):  # it hung forever, logging PeerUnavailable
        m.generate({"text": "hi"}, max_tokens=2)
    m.close()  # a second close is harmless


def test_close_ends_the_requests_still_open():
    m = MStar("toy")
    handle = m.submit({"text": "hi"}, max_tokens=100_000)
    events = iter(handle)
    next(events)
    threading.Timer(0.1, m.close).start()
    with pytest.raises(RequestFailed, match="shutting down"):  # it waited forever for a finish
        for _ in events:
            pass
    assert handle.finish is not None and handle.finish.status == 503
