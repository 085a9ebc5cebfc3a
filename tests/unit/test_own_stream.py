"""`AutoregressiveSpec.own_stream` (engines/own_stream.py): a no-op off CUDA; on CUDA the engine is built
and stepped inside its stream's scratch scope (kernels/scratch.py). The CUDA side runs here with
stand-ins for the stream calls; `tests/gpu/test_extras_lookahead_gpu.py` and
`tests/gpu/test_own_stream_scratch_gpu.py` run it on a GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mstar.config import config_from_dict
from mstar.engines.autoregressive import AutoregressiveEngine
from mstar.engines.base import AutoregressiveSpec, StatelessBase
from mstar.engines.own_stream import OwnStreamEngine, on_own_stream
from mstar.engines.stateless import StatelessEngine
from mstar.kernels.scratch import current_owner, scratch_owner
from mstar.models.base import BuiltComponent
from mstar.runtime.build import _engine
from tests.unit.test_ar_engine import TinyLM


class _Double(StatelessBase, torch.nn.Module):
    def run_batch(self, walk, node, inputs, options):
        return [{"y": x["x"] * 2} for x in inputs]


def test_cpu_engines_stay_plain_and_tensor_parallel_ones_seed_per_request():
    """`own_stream` wraps nothing off CUDA; a tensor-parallel engine samples with per-request seeds (its
    ranks must draw the same tokens), set on the engine itself before any wrapping."""
    config = config_from_dict({"model": "toy"})
    built = BuiltComponent(TinyLM(), AutoregressiveSpec(own_stream=True))
    engine = _engine(built, config, torch.device("cpu"), pages=8)
    assert type(engine) is AutoregressiveEngine and not engine.seed_per_request
    assert _engine(built, config, torch.device("cpu"), pages=8, tensor_parallel=True).seed_per_request
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

    host_inputs = True

    def __init__(self):
        self.built_under, self.stepped_under = current_owner(), None

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
