"""benchmarks/cosmos3_bench.py's request timing: a request ends when its outputs are on the host. In process
an output travels by reference, so a CUDA tensor (a policy's actions) can reach the client while the kernels
that compute it are still queued; a stand-in tensor whose host copy takes a while plays that part on CPU."""

from __future__ import annotations

import time

import torch

from benchmarks.cosmos3_bench import _wall
from mstar.runtime.offline import Result

HOST_COPY_S = 0.2


class _QueuedTensor(torch.Tensor):
    """A tensor whose copy to the host waits, as one whose producing kernels have not run yet."""

    def cpu(self, *args, **kwargs) -> torch.Tensor:
        time.sleep(HOST_COPY_S)
        return super().cpu(*args, **kwargs)


class _Handle:
    def result(self) -> Result:
        return Result(outputs={"actions": [torch.zeros(4, 10).as_subclass(_QueuedTensor)]}, finish_reason="stop")


class _Runtime:
    def submit(self, request: dict, **options) -> _Handle:
        return _Handle()


def test_a_request_ends_when_its_outputs_are_on_the_host() -> None:
    walls = _wall(_Runtime(), [({"text": "t"}, {}), ({"text": "t"}, {})], torch.device("cpu"))
    assert len(walls) == 2 and min(walls) >= HOST_COPY_S, walls
