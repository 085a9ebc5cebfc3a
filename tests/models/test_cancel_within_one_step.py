"""Cancelling a running request stops it within one step of every component (in-process runtime).

Every engine of the worker is wrapped to log its steps (with the request ids each step answered)
and its releases (with the engine's stats just before and after). The test marks the moment it
calls `cancel`; from that mark to the engine's `release` of the request, each engine may finish
at most the one step it was running, and after the release no step answers the request again.
"""

from __future__ import annotations

import threading

from mstar.runtime.offline import MStar

LLAMA = {"model": "llama", "device": "cpu", "kv_cache": {"max_num_pages": 256, "page_size": 16}}
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 1.0}


class StepLog:
    """A thread-safe log of ('cancel', rid), ('step', engine, rids) and ('release', engine, rid, before, after)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self._lock = threading.Lock()

    def add(self, *event) -> None:
        with self._lock:
            self.events.append(event)

    def wrap(self, name: str, engine) -> None:
        step, release = engine.step, engine.release

        def logged_step():
            results = step()
            self.add("step", name, [r.request_id for r in results])
            return results

        def logged_release(rid: str) -> None:
            before = engine.stats()
            release(rid)
            self.add("release", name, rid, before, engine.stats())

        engine.step, engine.release = logged_step, logged_release

    def after_cancel(self, rid: str) -> list[tuple]:
        with self._lock:
            events = list(self.events)
        return events[events.index(("cancel", rid)):]


def _instrument(m: MStar) -> StepLog:
    log = StepLog()
    for name, engine in m.runtime.workers[0].engines.items():
        log.wrap(name, engine)
    return log


def _cancel_after(m: MStar, log: StepLog, handle, outputs: int) -> None:
    """Wait for `outputs` output events of `handle`, then cancel it (marking the log first)."""
    for seen, _event in enumerate(handle, start=1):
        if seen == outputs:
            break
    log.add("cancel", handle.rid)
    assert m.runtime.cancel(handle.rid)
    _drain(handle)


def _drain(handle) -> None:
    for _ in handle:
        pass


def _is_release_of(event: tuple, rid: str) -> bool:
    # engines see the conductor's wire id: the caller's id, '#', the admission number
    return event[0] == "release" and event[2].split("#")[0] == rid


def _assert_within_one_step(events: list[tuple], rid: str, engines: set[str]) -> dict[str, tuple]:
    """At most one step per engine between the cancel mark and its release of `rid`; no step answers
    the request afterwards. Returns engine -> (stats before release, stats after)."""
    released = {}
    for name in engines:
        mine = [e for e in events[1:] if e[1] == name]
        at = next((i for i, e in enumerate(mine) if _is_release_of(e, rid)), None)
        assert at is not None, f"{name} never released {rid}"
        assert sum(e[0] == "step" for e in mine[:at]) <= 1, f"{name} stepped more than once before releasing"
        late = [e for e in mine[at + 1:] if e[0] == "step" and mine[at][2] in e[2]]
        assert not late, f"{name} answered the cancelled request after releasing it"
        released[name] = mine[at][3:]
    return released


def test_stateless_engines_drop_a_cancelled_request_within_one_step():
    config = {"model": "toy", "model_kwargs": {"step_delay_s": 0.01}}
    with MStar("toy", config=config) as m:
        log = _instrument(m)
        opts = {"max_tokens": 60, "stop_early": False}
        target, *others = [m.submit({"text": f"request {i}"}, **opts) for i in range(3)]
        _cancel_after(m, log, target, outputs=6)
        assert target.finish.finish_reason == "cancelled"
        results = [o.result() for o in others]  # the other requests are untouched
        events = log.after_cancel(target.rid)
    assert all(len(r.outputs["text"]) == 60 and r.finish_reason == "length" for r in results)
    released = _assert_within_one_step(events, target.rid, set(m.runtime.workers[0].engines))
    # The decoder holds the cancelled request's next node call (Parallel: cond then uncond) or the
    # guide's; release removed it from the queue while the other requests' items stayed.
    dropped = {name: before["queue_depth"] - after["queue_depth"] for name, (before, after) in released.items()}
    assert sum(dropped.values()) >= 1, released


def test_autoregressive_engine_frees_kv_pages_within_one_step():
    with MStar("llama", config=LLAMA, tiny=True) as m:
        log = _instrument(m)
        target = m.submit({"text": "cancel me after a few tokens"}, **LONG)
        other = m.submit({"text": "I run to the end"}, **{**LONG, "max_tokens": 40})
        _cancel_after(m, log, target, outputs=20)
        assert len(list(other)) == 40 and other.finish.finish_reason == "length"
        events = log.after_cancel(target.rid)
        final = m.runtime.workers[0].engines["llm"].stats()
    before, after = _assert_within_one_step(events, target.rid, {"llm"})["llm"]
    assert before["kv_pages_used"] >= 2  # prompt + 20 tokens: at least two 16-token pages
    assert after["kv_pages_used"] < before["kv_pages_used"] and after["seqs_running"] == before["seqs_running"] - 1
    assert final["kv_pages_used"] == 0 and final["queue_depth"] == 0


def test_a_long_denoising_request_stops_within_one_step(tmp_path):
    """A Wan2.2 request of the most steps it takes (tiny model): cancelled after a few steps, the DiT and the
    scheduler each finish at most the step they were running, no decode runs, and the worker serves the next one."""
    from tests.models.wan22_testing import write_pipeline_dir

    root = write_pipeline_dir(tmp_path)
    opts = {"num_inference_steps": 200, "report_progress": True, "guidance_scale": 5.0}
    with MStar("wan22", tiny=True, model_path=str(root)) as m:
        log = _instrument(m)
        target = m.submit({"text": "a long clip"}, seed=0, **opts)
        _cancel_after(m, log, target, outputs=3)
        assert target.finish.finish_reason == "cancelled"
        after = m.submit({"text": "the next one"}, seed=1, num_inference_steps=2).result()
        events = log.after_cancel(target.rid)
    _assert_within_one_step(events, target.rid, {"dit", "scheduler"})
    assert not [e for e in events if e[0] == "step" and e[1] == "vae" and any(
        r.split("#")[0] == target.rid for r in e[2])], "the cancelled request was decoded"
    assert after.finish_reason != "cancelled" and "video" in after.outputs
