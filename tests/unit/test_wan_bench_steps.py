"""benchmarks/wan_bench.py's step timestamps: the denoising walk never waits for the GPU, so on CUDA a step's
end is a CUDA event recorded after its scheduler update, not the arrival of its progress event. On CPU a
stand-in event that records the host clock plays the CUDA event; the tiny model runs for real, so the
events must be recorded under the submitted request ids, one per step."""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks import wan_bench
from mstar.models.wan22.combine import GuidanceScheduler
from mstar.runtime.offline import MStar

STEPS = 3


class _Event:
    """torch.cuda.Event's timing surface, on the host clock."""

    recorded: list[_Event] = []

    def __init__(self, enable_timing: bool = False) -> None:
        self.t: float | None = None

    def record(self) -> None:
        self.t = time.perf_counter()
        _Event.recorded.append(self)

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch):
    _Event.recorded = []
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(wan_bench, "_sync", lambda device: None)
    return torch.device("cuda")


def test_on_cuda_the_steps_are_the_events_recorded_after_each_scheduler_update(fake_cuda) -> None:
    real = GuidanceScheduler._combine
    torch.manual_seed(0)
    with MStar(config=wan_bench._ours_config(True, "float32"), tiny=True, load_format="auto") as m:
        timelines = wan_bench.run_ours(m, ["a cat", "a dog"], {"width": 64, "height": 64, "num_frames": 5},
                                       STEPS, 5.0, fake_cuda)
    assert GuidanceScheduler._combine is real  # the hook is gone after the run
    origin, *steps = _Event.recorded
    expected = sorted(timelines[0]["start"] + (e.t - origin.t) for e in steps)
    marks = sorted(mark for t in timelines for mark in t["steps"])
    assert marks == pytest.approx(expected, abs=1e-9) and len(marks) == 2 * STEPS
    for t in timelines:
        assert len(t["steps"]) == STEPS and t["start"] < t["steps"][0] < t["steps"][-1] < t["end"]
    row = wan_bench.summarize(timelines, STEPS)
    assert row["decode_s"] > 0 and row["s_per_step"] > 0
