"""benchmarks/soak.py in small: mixed good, bad and abandoned requests and a killed worker on the toy
over two processes leave no request, KV page or shared-memory segment behind."""

from __future__ import annotations

import pytest

from benchmarks.soak import main
from tests.e2e.server_thread import free_port


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_a_short_soak_leaks_nothing():
    (phase,) = main(["--requests", "120", "--clients", "6", "--servers", "toy_2workers", "--port", str(free_port())])[
        "phases"]
    answers = phase["answers"]
    assert phase["requests"] == 120 and phase["killed_worker_pid"] is not None
    assert all(400 <= int(kind.split()[1]) < 500 for kind in answers if kind.startswith("bad")), answers
    # the killed worker's requests fail (500) and, until it is back, its component has no replica (503)
    assert {kind for kind in answers if kind.startswith(("good", "left"))} <= {
        "good 200", "good 500", "good 503", "left 200", "left 500", "left 503"}, answers
    assert not any(kind.startswith("transport") for kind in answers), answers
    assert set(phase["idle_gauges"].values()) == {0.0}, phase["idle_gauges"]
    assert phase["shm_segments_left"] == 0 and phase["exit_code"] == 0
    assert phase["server_rss_growth_mb"] < 100
