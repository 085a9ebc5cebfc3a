"""`own_stream` engine option (engines/own_stream.py): taken out of the options before the engine is made,
and a no-op off CUDA; on CUDA the engine is built and stepped inside its stream's scratch scope
(kernels/scratch.py), and attributes set on the wrapper reach the engine. The CUDA side runs here with
stand-ins for the stream calls; `tests/gpu/test_extras_lookahead_gpu.py` and
`tests/gpu/test_own_stream_scratch_gpu.py` run it on a GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mstar.config import config_from_dict
from mstar.engines.own_stream import OwnStreamEngine, on_own_stream
from mstar.engines.stateless import StatelessEngine
from mstar.kernels.scratch import current_owner, scratch_owner
from mstar.models.base import BuiltComponent
from mstar.runtime.build import _engine


class _Double(torch.nn.Module):
    def run_batch(self, items):
        return [{"y": item.inputs["x"] * 2} for item in items]


def test_own_stream_option_is_taken_out_and_cpu_engines_stay_plain():
    built = BuiltComponent(_Double(), {"max_batch_size": 4, "own_stream": True})
    engine = _engine("stateless", built, config_from_dict({"model": "toy"}), torch.device("cpu"))
    assert type(engine) is StatelessEngine and engine.max_batch_size == 4
    assert built.engine_options == {"max_batch_size": 4, "own_stream": True}  # the component's dict is untouched
    made = StatelessEngine(_Double())
    assert on_own_stream(lambda: made, torch.device("cpu")) is made


class _Stream:
    """Stands in for torch.cuda.Stream: remembers what it waited for."""

    def __init__(self, device=None):
        self.waited = []

    def wait_stream(self, other):
        self.waited.append(other)


class _Engine:
    """Records the scratch owner it was built and stepped under."""

    def __init__(self):
        self.built_under, self.stepped_under, self.seed_per_request = current_owner(), None, False

    def step(self):
        self.stepped_under = current_owner()
        return []


@pytest.fixture
def fake_cuda(monkeypatch):
    worker = _Stream()
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: worker)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    return worker


def test_engine_is_built_and_stepped_in_its_streams_scratch_scope(fake_cuda):
    wrapped = on_own_stream(_Engine, torch.device("cuda", 0))
    assert isinstance(wrapped, OwnStreamEngine)
    inner, stream = wrapped.engine, wrapped.stream
    assert inner.built_under is stream and current_owner() is None  # graphs captured, kernels warmed for it
    assert wrapped.step() == [] and inner.stepped_under is stream
    assert stream.waited == [fake_cuda]  # the step waited for the worker's stream first


def test_attributes_set_on_the_wrapper_reach_the_engine(fake_cuda):
    """runtime/replicas.py sets `seed_per_request` on a tensor-parallel engine: on the wrapper it would
    never reach the engine, whose ranks would then draw different tokens."""
    wrapped = on_own_stream(_Engine, torch.device("cuda", 0))
    wrapped.seed_per_request = True
    assert wrapped.engine.seed_per_request is True and "seed_per_request" not in vars(wrapped)


def test_split_k_scratch_is_kept_per_owner():
    """The GEMV and skinny-GEMM caches give an engine on a stream of its own buffers of its own: shared,
    two streams' launches would add up each other's partial sums and count each other's tiles."""
    pytest.importorskip("triton")
    from mstar.kernels import gemv, skinny_gemm

    cpu = torch.device("cpu")
    shared = gemv._buffer("lock", cpu, 7), gemv._buffer("ws", cpu, 64), skinny_gemm._workspace(cpu, 96)
    with scratch_owner("thinker stream"):
        own = gemv._buffer("lock", cpu, 7), gemv._buffer("ws", cpu, 64), skinny_gemm._workspace(cpu, 96)
        again = gemv._buffer("lock", cpu, 7), gemv._buffer("ws", cpu, 64), skinny_gemm._workspace(cpu, 96)
    for a, b, c in zip(shared, own, again, strict=True):
        assert a.data_ptr() != b.data_ptr() and b.data_ptr() == c.data_ptr()
    assert gemv._buffer("lock", cpu, 7).data_ptr() == shared[0].data_ptr()  # the scope ended
