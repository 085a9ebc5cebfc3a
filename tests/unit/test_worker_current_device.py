"""Each worker makes its own device current on the thread that runs its engines (`build.use_device`):
CUDA graph captures, streams, events and Triton launches that name no device take the current one, so
without it every worker of a multi-GPU host would capture and launch on cuda:0."""

import threading

import pytest
import torch

from mstar.runtime import build, launcher
from mstar.runtime.offline import MStar


def test_use_device_sets_a_cuda_device_and_leaves_cpu_alone(monkeypatch):
    set_to = []
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    build.use_device(torch.device("cpu"))
    build.use_device(torch.device("cuda", 1))
    assert set_to == [torch.device("cuda", 1)]


@pytest.mark.parametrize("config", ["toy_2workers", "toy_3workers"])
def test_each_in_process_worker_makes_its_device_current_on_its_own_thread(monkeypatch, config):
    calls = []

    def record(device):
        calls.append((threading.current_thread().name, device))

    monkeypatch.setattr(launcher, "use_device", record)
    with MStar(config=config, mode="inproc") as m:
        assert m.submit({"text": "abc"}, max_tokens=2).result().finish_reason
    workers = int(config[4])
    assert sorted(name for name, _ in calls) == [f"mstar-worker-{r}" for r in range(workers)]
    assert all(device == torch.device("cpu") for _, device in calls)
