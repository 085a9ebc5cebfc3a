"""An engine that raises outside its own per-item isolation fails exactly the requests with items in
it — also when the request is driven by another worker (it gets a NodeDone with the error instead of
waiting forever) — and leaves every other request and no state behind."""

from __future__ import annotations

import time

import pytest

from mstar.config import config_from_dict
from mstar.runtime.offline import MStar, RequestFailed


def _arm_crash(engine, option: str, m: MStar, monkeypatch) -> None:
    """The engine's next step raises once an item of a request with `option` set arrived (an option the
    model is made to take, as the offline API refuses any other)."""
    model = type(m.runtime.model)
    monkeypatch.setattr(model, "extra_options", model.extra_options | {option})
    submit, step = engine.submit, engine.step
    armed = []

    def crash_submit(item):
        if item.options.get(option):
            armed.append(True)
        submit(item)

    def crash_step():
        if armed:
            armed.clear()
            raise RuntimeError("boom")
        return step()

    engine.submit, engine.step = crash_submit, crash_step


def _wait(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.mark.timeout(60)  # before the fix the crashing request waited forever
def test_a_crashing_engine_answers_the_remote_node_it_ran(monkeypatch):
    """The guide runs on worker 0 for a walk driven by the decoder's worker: its crash must reach that
    driver as a failed node, not leave the request waiting."""
    cfg = config_from_dict({"model": "toy", "node_groups": [
        {"node_names": ["encoder", "guide", "painter", "vocoder"], "ranks": [0]},
        {"node_names": ["decoder"], "ranks": [1]},
    ]})
    with MStar(config=cfg, mode="inproc") as m:
        _arm_crash(m.runtime.workers[0].engines["guide"], "crash_guide", m, monkeypatch)
        crashing = m.submit({"text": "crash"}, max_tokens=40, stop_early=False, modalities=["text"],
                            crash_guide=True)
        with pytest.raises(RequestFailed, match="guide failed: RuntimeError: boom"):
            crashing.result()
        after = m.generate({"text": "after"}, max_tokens=4, modalities=["text"])
        assert len(after.outputs["text"]) == 4
        _wait(lambda: all(w.state_size() == 0 for w in m.runtime.workers.values()))
        assert m.runtime.conductor.stats() == {"in_flight": 0, "queued": 0}
        assert not any(e.has_work() for w in m.runtime.workers.values() for e in w.engines.values())


@pytest.mark.timeout(60)
def test_requests_without_items_in_the_crashing_engine_go_on(monkeypatch):
    cfg = config_from_dict({"model": "toy", "model_kwargs": {"step_delay_s": 0.01}, "node_groups": [
        {"node_names": ["encoder", "guide", "painter", "vocoder"], "ranks": [0]},
        {"node_names": ["decoder"], "ranks": [1, 2]},  # two replicas: the two requests get one each
    ]})
    with MStar(config=cfg, mode="inproc") as m:
        for rank in (1, 2):
            _arm_crash(m.runtime.workers[rank].engines["decoder"], "crash_decoder", m, monkeypatch)
        crashing = m.submit({"text": "crash"}, max_tokens=40, stop_early=False, modalities=["text"],
                            crash_decoder=True)
        healthy = m.submit({"text": "fine"}, max_tokens=40, stop_early=False, modalities=["text"])
        with pytest.raises(RequestFailed, match="decoder failed: RuntimeError: boom"):
            crashing.result()
        assert len(healthy.result().outputs["text"]) == 40
        _wait(lambda: all(w.state_size() == 0 for w in m.runtime.workers.values()))
        assert m.runtime.conductor.stats() == {"in_flight": 0, "queued": 0}
