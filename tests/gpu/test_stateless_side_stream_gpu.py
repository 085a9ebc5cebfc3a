"""A side-stream component (engines/stateless.py) given a device input still being written on the default
stream reads the written values: its stream waits for that work on the GPU, and the host does not."""

from __future__ import annotations

import torch
from torch import nn

from mstar.engines.base import StatelessBase, StepItem
from mstar.engines.stateless import StatelessEngine

N = 1 << 20


class _Summer(StatelessBase, nn.Module):
    host_inputs = host_outputs = side_stream = True

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("one", torch.ones((), device="cuda"))

    def run_batch(self, walk, node, inputs, options):
        return [{"sum": (x["x"] * self.one).sum()[None]} for x in inputs]


def test_side_stream_step_waits_for_its_device_inputs_on_the_gpu():
    engine = StatelessEngine(_Summer())
    assert engine.stream is not None
    # One step first: with CUDA's lazy module loading, the first launch of a kernel (the multiply, the
    # sum, the copy out) loads its module, which may wait for the device to go idle. That wait is
    # CUDA's, once per kernel, not the engine's; the check below is about every later step.
    engine.submit(StepItem("warm", "w", "n", {"x": torch.ones(N, device="cuda")}))
    while engine.has_work():
        engine.step()
    x = torch.zeros(N, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # keeps the default stream busy for a while (~0.5 s on an H200)
    x.fill_(1.0)  # queued behind the sleep
    engine.submit(StepItem("r", "w", "n", {"x": x}))
    results = engine.step()
    assert not torch.cuda.current_stream().query(), "the step waited on the host for the default stream"
    del x  # the engine recorded it on its stream: its block is not handed out again before the sum read it
    y = torch.full((N,), 5.0, device="cuda")  # likely reuses that block, written on the default stream
    while engine.has_work():
        results += engine.step()
    assert [float(r.outputs["sum"]) for r in results] == [float(N)]
    assert float(y[0]) == 5.0


def test_host_copies_of_views_of_one_buffer_copy_it_once():
    """Outputs packed into one buffer reach the host as views of one copy; a view of a larger buffer
    and a plain tensor are copied alone; every value equals its device original."""
    from mstar.engines import stateless
    from mstar.engines.base import StepResult

    packed = torch.arange(10, dtype=torch.float32, device="cuda") * 1.5
    big = torch.randn(64, 8, device="cuda")
    plain = torch.randn(3, device="cuda")
    results = [StepResult(f"r{i}", "w", "n", {"audio": packed[lo:hi]}) for i, (lo, hi) in enumerate([(0, 3), (3, 10)])]
    results.append(StepResult("r2", "w", "n", {"audio": big[5, 2:6], "extra": plain}))
    want = [{k: v.cpu() for k, v in r.outputs.items()} for r in results]
    copies = []
    real = stateless.to_host_async
    stateless.to_host_async = lambda t: copies.append(t.numel()) or real(t)
    try:
        event = stateless.start_host_copies(results)
    finally:
        stateless.to_host_async = real
    event.synchronize()
    assert sorted(copies) == [3, 4, 10]  # packed once (10), the row of `big` alone (4), `plain` (3)
    for r, w in zip(results, want):
        for port, value in r.outputs.items():
            assert value.device.type == "cpu" and torch.equal(value, w[port]), (r.request_id, port)
    assert results[0].outputs["audio"].untyped_storage().data_ptr() == results[1].outputs["audio"].untyped_storage().data_ptr()
