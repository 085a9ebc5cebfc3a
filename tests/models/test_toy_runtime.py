"""The toy model through the whole runtime: same outputs in every placement and run mode,
ordered streams, dynamic loop stops, cancellation without leaks, and worker failures."""

import logging
import os
import re
import signal
import time

import numpy as np
import pytest
import torch

from mstar.config import config_from_dict, load_config
from mstar.models.base import OptionError
from mstar.runtime.offline import MStar, RequestFailed
from mstar.transport.tensors import list_segments

PROMPTS = ["The quick brown fox", "hello", "abc", "mstar serves composite models"]
CONFIGS = ["toy", "toy_2workers", "toy_3workers"]


def run_all(m, **options):
    handles = [m.submit({"text": p}, request_id=f"r{i}", **options) for i, p in enumerate(PROMPTS)]
    return [h.result() for h in handles]


def as_arrays(results):
    return [{k: [np.asarray(v.cpu() if isinstance(v, torch.Tensor) else v) for v in vs]
             for k, vs in r.outputs.items()} for r in results]


@pytest.fixture(scope="module")
def reference():
    with MStar(config="toy", mode="inproc") as m:
        return as_arrays(run_all(m, max_tokens=24)), [r.finish_reason for r in run_all(m, max_tokens=24)]


@pytest.fixture(scope="module")
def three_workers():
    """The three-worker placement over processes, started once for the tests that only submit to it."""
    with MStar(config="toy_3workers", mode="multiproc") as m:
        yield m


# Every placement in process; over processes the three-worker placement by default (the next test), the
# others in the slow group
@pytest.mark.parametrize(("config", "mode"), [(c, "inproc") for c in CONFIGS] + [
    pytest.param(c, "multiproc", marks=pytest.mark.slow) for c in CONFIGS if c != "toy_3workers"])
def test_same_outputs_in_every_placement_and_mode(reference, config, mode):
    with MStar(config=config, mode=mode) as m:
        _check_same_outputs(reference, run_all(m, max_tokens=24))


def test_same_outputs_over_three_worker_processes(reference, three_workers):
    _check_same_outputs(reference, run_all(three_workers, max_tokens=24))


def _check_same_outputs(reference, results) -> None:
    expected, reasons = reference
    assert [r.finish_reason for r in results] == reasons
    for got, want in zip(as_arrays(results), expected):
        assert got.keys() == want.keys() == {"text", "audio", "image", "video"}
        for name in want:
            assert len(got[name]) == len(want[name])
            for a, b in zip(got[name], want[name]):
                np.testing.assert_array_equal(a, b)


def test_streamed_chunks_arrive_complete_and_in_order(three_workers):
    handle = three_workers.submit({"text": "The quick brown fox"}, max_tokens=30, stop_early=False)
    events = list(handle)
    seqs = {}
    for event in events:
        seqs.setdefault(event.name, []).append(event.seq)
    for name, got in seqs.items():
        assert got == list(range(len(got))), name
    tokens = [int(e.value) for e in events if e.name == "text"]
    assert len(tokens) == 30 and handle.finish.finish_reason == "length"
    audio = torch.cat([e.value for e in events if e.name == "audio"])
    # The stream carries the encoder's first token (last prompt byte) and every generated token;
    # every token is voiced exactly once, in order, whatever the window cuts.
    voiced = torch.tensor([ord("x")] + tokens, dtype=torch.float64)
    k = torch.arange(8, dtype=torch.float64)
    want = torch.sin(2 * torch.pi * (voiced[:, None] / 256.0) * (k[None, :] + 1)).reshape(-1).float()
    torch.testing.assert_close(audio, want, rtol=0, atol=0)


def test_loop_stops_early_on_its_dynamic_condition():
    with MStar("toy") as m:
        stopped = m.generate({"text": "abc"}, max_tokens=20)
        full = m.generate({"text": "abc"}, max_tokens=20, stop_early=False)
    assert len(stopped.outputs["text"]) == 2 and stopped.finish_reason == "stop"
    assert ord(stopped.outputs["text"][-1]) % 11 == 0
    assert len(full.outputs["text"]) == 20 and full.finish_reason == "length"
    assert full.outputs["text"][:2] == stopped.outputs["text"]


def test_audio_lane_is_skipped_when_not_asked_for():
    with MStar("toy") as m:
        result = m.generate({"text": "hello"}, max_tokens=5, modalities=["text"])
    assert "audio" not in result.outputs and len(result.outputs["text"]) == 5


def test_the_painter_runs_only_when_modalities_ask_for_image_or_video():
    # it painted every request, so `modalities` without image and video changed nothing but the audio lane
    with MStar("toy") as m:
        text = m.generate({"text": "hello"}, max_tokens=5, stop_early=False, modalities=["text"])
        video = m.generate({"text": "hello"}, max_tokens=5, stop_early=False, modalities=["video"])
    assert sorted(text.outputs) == ["text"] and text.finish_reason == "length"
    assert {"image", "video"} <= set(video.outputs) and video.outputs["text"] == text.outputs["text"]
    assert np.asarray(video.outputs["video"][0]).shape[:3] == (2, 8, 5)  # two frames of one pixel per token


def test_bad_requests_fail_alone(monkeypatch):
    from mstar.runtime import offline

    with MStar("toy") as m:
        with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
            m.generate({"text": "hi"}, max_tokens=-3)
        with pytest.raises(ValueError, match="non-empty text prompt"):
            m.submit({"text": ""})
        with pytest.raises(ValueError, match="option 'guidance' must be a number"):
            m.submit({"text": "hi"}, guidance="strong")
        with pytest.raises(OptionError, match="takes no option 'max_tokenz' \\(did you mean 'max_tokens'\\?\\); it takes "
                                              "guidance, height, max_tokens") as info:
            m.generate({"text": "hi"}, max_tokenz=8)  # it ran 16 tokens, the default, before options were declared
        assert info.value.option == "max_tokenz"
        monkeypatch.setattr(offline, "check_option_types", lambda defaults, options: None)
        bad = m.submit({"text": "hi"}, guidance="strong")  # past the edge check: fails inside the guide component
        good = m.submit({"text": "hello"}, max_tokens=5)
        with pytest.raises(RequestFailed, match="guide failed"):
            bad.result()
        assert len(good.result().outputs["text"]) == 5


def test_200_cancelled_requests_leave_no_state_inproc():
    with MStar(config={"model": "toy", "model_kwargs": {"step_delay_s": 0.005}}) as m:
        handles = [m.submit({"text": f"req {i}"}, max_tokens=100_000, stop_early=False) for i in range(200)]
        time.sleep(0.3)
        assert all(h.cancel() for h in handles)
        for h in handles:
            list(h)
            assert h.finish.finish_reason == "cancelled"
        _wait(lambda: all(w.state_size() == 0 for w in m.runtime.workers.values()))
        assert m.runtime.conductor.stats() == {"in_flight": 0, "queued": 0}
        assert not any(e.has_work() for w in m.runtime.workers.values() for e in w.engines.values())
        assert len(m.generate({"text": "hello"}, max_tokens=3).outputs["text"]) == 3


def test_200_cancelled_requests_leave_no_shared_memory_across_processes():
    # hidden=9000 makes the context vector 72 KB: it crosses processes through shared memory.
    cfg = load_config("toy_3workers")
    cfg.model_kwargs = {"hidden": 9000, "step_delay_s": 0.002}
    with MStar(config=cfg, mode="multiproc") as m:
        handles = [m.submit({"text": f"req {i}"}, max_tokens=100_000, stop_early=False) for i in range(200)]
        time.sleep(1.0)
        for h in handles:
            h.cancel()
            list(h)
        _wait(lambda: not list_segments(m.runtime.session), timeout=10)
        assert m.runtime.conductor.stats() == {"in_flight": 0, "queued": 0}
        assert len(m.generate({"text": "hello"}, max_tokens=3).outputs["text"]) == 3
        assert not list_segments(m.runtime.session)


def test_cpu_worker_processes_run_their_share_of_the_cores(monkeypatch, capfd, caplog):
    """Two CPU workers on a host of 12 cores run 6 intra-op threads each (the workers log what torch
    reports); the cores are patched so the share differs from any default of this machine."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("mstar.runtime.process.host_cores", lambda: 12)
    caplog.set_level(logging.INFO)  # the workers log at the launching process's level
    with MStar(config=config_from_dict({"model": "toy", "device": "cpu", "node_groups": [
        {"node_names": ["encoder", "guide", "painter", "vocoder"], "ranks": [0]},
        {"node_names": ["decoder"], "ranks": [1]},
    ]}), mode="multiproc") as m:
        assert len(m.generate({"text": "hello"}, max_tokens=3).outputs["text"]) == 3
    reported = re.findall(r"worker (\d+): (\d+) intra-op threads", capfd.readouterr().err)
    assert sorted(reported) == [("0", "6"), ("1", "6")]


def test_killed_worker_fails_only_its_requests():
    cfg = config_from_dict({"model": "toy", "model_kwargs": {"step_delay_s": 0.02}, "node_groups": [
        {"node_names": ["encoder", "guide", "painter", "vocoder"], "ranks": [0]},
        {"node_names": ["decoder"], "ranks": [1, 2]},
    ]})
    with MStar(config=cfg, mode="multiproc") as m:
        handles = [m.submit({"text": f"req {i}"}, max_tokens=40, stop_early=False, modalities=["text"])
                   for i in range(8)]
        time.sleep(0.5)
        os.kill(m.runtime.workers[2].pid, signal.SIGKILL)
        failed, done = 0, 0
        for h in handles:
            try:
                assert len(h.result().outputs["text"]) == 40
                done += 1
            except RequestFailed as exc:
                assert "worker 2 died: was killed by signal SIGKILL" in str(exc) and exc.status == 500
                failed += 1
        assert failed == 4 and done == 4  # least-loaded placement split them evenly
        assert len(m.generate({"text": "after"}, max_tokens=4, modalities=["text"]).outputs["text"]) == 4
        _wait(lambda: m.runtime.ready, timeout=60)  # restarted (weights built again) and ready
        assert m.runtime.workers[2].is_alive() and m.runtime.fatal is None
        again = [m.submit({"text": f"again {i}"}, max_tokens=8, stop_early=False, modalities=["text"])
                 for i in range(4)]
        assert all(len(h.result().outputs["text"]) == 8 for h in again)
        assert m.runtime.conductor._load == [0, 0, 0] and not m.runtime.conductor._dead


def test_a_worker_that_keeps_dying_makes_the_runtime_give_up():
    from mstar.runtime.supervisor import RestartPolicy

    cfg = config_from_dict({"model": "toy", "node_groups": [
        {"node_names": ["encoder", "guide", "painter", "vocoder"], "ranks": [0]}, {"node_names": ["decoder"], "ranks": [1]}]})
    with MStar(config=cfg, mode="multiproc") as m:
        m.runtime._restarts = RestartPolicy(limit=2, first_delay_s=0.1)
        gave_up = []
        m.runtime.on_fatal(lambda: gave_up.append(m.runtime.fatal))
        first = m.runtime.workers[1]
        os.kill(first.pid, signal.SIGKILL)
        _wait(lambda: m.runtime.workers[1] is not first and m.runtime.ready, timeout=60)  # restarted once
        os.kill(m.runtime.workers[1].pid, signal.SIGKILL)
        _wait(lambda: gave_up, timeout=30)
        assert "worker 1 was killed by signal SIGKILL, the 2th time" in gave_up[0]
        assert not m.runtime.ready


def test_drain_ends_open_requests_with_an_error_at_its_deadline():
    with MStar(config={"model": "toy", "model_kwargs": {"step_delay_s": 0.02}}) as m:
        quick = m.submit({"text": "quick"}, max_tokens=3, stop_early=False)
        slow = m.submit({"text": "slow"}, max_tokens=100_000, stop_early=False)
        assert len(quick.result().outputs["text"]) == 3
        m.runtime.drain(0.3)
        assert not m.runtime.ready
        with pytest.raises(RequestFailed, match="shutting down") as exc:
            slow.result()
        assert exc.value.status == 503
        assert m.runtime.conductor.stats() == {"in_flight": 0, "queued": 0}


def _wait(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_full_queue_rejects_instead_of_growing():
    from mstar.conductor.conductor import AdmissionError

    cfg = config_from_dict({"model": "toy", "max_concurrent_requests": 1, "max_queued_requests": 1,
                            "model_kwargs": {"step_delay_s": 0.01}})
    with MStar(config=cfg) as m:
        running = m.submit({"text": "one"}, max_tokens=50, stop_early=False)
        queued = m.submit({"text": "two"}, max_tokens=3, stop_early=False)
        assert m.runtime.conductor.stats() == {"in_flight": 1, "queued": 1}
        with pytest.raises(AdmissionError, match="server busy") as exc:
            m.submit({"text": "three"}, max_tokens=3)
        assert exc.value.status == 429
        assert len(running.result().outputs["text"]) == 50
        assert len(queued.result().outputs["text"]) == 3  # admitted once the first finished


def test_decoded_handles_give_what_generate_gives():
    """Several requests in flight at once, each read through `decoded()`: the client values `generate`
    returns one at a time (text as str pieces, not the emitted token tensors of `result()`)."""
    with MStar("toy") as m:
        prompts = [{"text": f"prompt {i}"} for i in range(3)]
        alone = [m.generate(p, max_tokens=5) for p in prompts]
        handles = [m.submit(p, max_tokens=5) for p in prompts]
        together = [h.decoded() for h in handles]
        raw = m.submit(prompts[0], max_tokens=5).result()
    for want, got in zip(alone, together, strict=True):
        assert got.finish_reason == want.finish_reason and got.outputs.keys() == want.outputs.keys()
        assert got.outputs["text"] == want.outputs["text"] and all(isinstance(t, str) for t in got.outputs["text"])
        for name in ("audio", "image", "video"):
            assert all(np.array_equal(g, w) for g, w in zip(got.outputs[name], want.outputs[name], strict=True))
    assert not isinstance(raw.outputs["text"][0], str)  # result(): as emitted


def test_the_watchdog_reports_a_server_with_requests_in_flight_and_no_worker_news(monkeypatch):
    monkeypatch.setenv("MSTAR_WATCHDOG_S", "1")
    with MStar(config={"model": "toy", "model_kwargs": {"step_delay_s": 1.5}}) as m:
        assert m.runtime.health_problem() is None  # idle
        slow = m.submit({"text": "slow"}, max_tokens=1, stop_early=False, modalities=["text"])
        problems = []
        for _ in range(40):  # 2 s into a run whose steps each sleep 1.5 s, a second more than allowed
            problems.append(m.runtime.health_problem())
            time.sleep(0.05)
        assert any(p and "no worker has reported" in p for p in problems), problems
        assert len(slow.result().outputs["text"]) == 1
        assert m.runtime.health_problem() is None  # idle again


def test_an_in_process_worker_thread_that_dies_fails_its_requests_and_the_runtime_gives_up(monkeypatch):
    from mstar.worker.worker import Worker

    def broken(self: Worker) -> None:  # an error outside any request's handling ends the thread
        if any(engine.has_work() for engine in self.engines.values()):
            raise RuntimeError("engine state lost")

    with MStar(config={"model": "toy"}, mode="inproc") as m:
        gave_up = []
        m.runtime.on_fatal(lambda: gave_up.append(m.runtime.fatal))
        monkeypatch.setattr(Worker, "execute", broken)
        with pytest.raises(RequestFailed) as failed:
            m.submit({"text": "abc"}, max_tokens=4).result()
        assert "worker 0 died: stopped: RuntimeError: engine state lost" in str(failed.value)
        _wait(lambda: gave_up, timeout=10)
        assert "in-process worker 0 stopped: RuntimeError: engine state lost" in gave_up[0]
        with pytest.raises(RequestFailed) as later:  # nothing serves any more: refused, not queued
            m.submit({"text": "after"}, max_tokens=2).result()
        assert later.value.status == 503
