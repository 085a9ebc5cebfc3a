"""`AutoregressiveSpec.own_stream` (engines/own_stream.py): a no-op off CUDA; on CUDA the engine is built
and stepped inside its stream's scratch scope (kernels/scratch.py), and an engine that moves sequences
between workers (`KVHandoff`) stays one, its K/V sent and placed in stream order. The CUDA side runs here
with stand-ins for the stream calls; `tests/gpu/test_extras_lookahead_gpu.py`,
`tests/gpu/test_own_stream_scratch_gpu.py` and `tests/gpu/test_pd_own_stream_gpu.py` run it on a GPU."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from mstar.config import config_from_dict
from mstar.engines.autoregressive import AutoregressiveEngine
from mstar.engines.base import AutoregressiveSpec, LoopSpec, StatelessBase, StepItem
from mstar.engines.kv_cache.config import KVCacheConfig
from mstar.engines.kv_handoff import KVHandoff
from mstar.engines.own_stream import KVOwnStreamEngine, OwnStreamEngine, on_own_stream
from mstar.engines.sampling import SamplingParams
from mstar.engines.stateless import StatelessEngine
from mstar.kernels.scratch import current_owner, scratch_owner
from mstar.models.base import BuiltComponent
from mstar.runtime.build import _engine
from mstar.runtime.codecs import LocalCodec
from mstar.transport import wire
from mstar.worker.kv_moves import KVMoves
from tests.unit.test_ar_engine import LAYERS, TinyLM, make_engine, prompts

GREEDY = {"temperature": 0.0, "ignore_eos": True}


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
    """Stands in for torch.cuda.Stream: remembers what it waited for, and notes each wait in `log`."""

    log: list = []

    def __init__(self, device=None, name="own"):
        self.name, self.waited = name, []

    def wait_stream(self, other):
        self.waited.append(other)
        self.log.append(("wait", self.name, other.name))


class _Engine:
    """Records the scratch owner it was built and stepped under."""

    host_inputs = True

    def __init__(self):
        self.built_under, self.stepped_under = current_owner(), None

    def step(self):
        self.stepped_under = current_owner()
        return []


def fake_streams(monkeypatch) -> _Stream:
    """CUDA's stream calls stood in for, per thread as CUDA keeps them: `torch.cuda.stream(s)` makes `s`
    current; the worker's stream (returned) is current otherwise. Engines stay on the CPU."""
    worker, local = _Stream(name="worker"), threading.local()
    monkeypatch.setattr(_Stream, "log", [])

    @contextlib.contextmanager
    def stream(s):
        previous, local.current = getattr(local, "current", worker), s
        try:
            yield
        finally:
            local.current = previous

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: getattr(local, "current", worker))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    return worker


@pytest.fixture
def fake_cuda(monkeypatch):
    return fake_streams(monkeypatch)


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


class _Noted(AutoregressiveEngine):
    """Notes the stream current when it writes moved K/V into its cache."""

    def place_kv(self, request_id, kv_slot, layer, start, k, v):
        _Stream.log.append(("place", torch.cuda.current_stream().name))
        super().place_kv(request_id, kv_slot, layer, start, k, v)


class _Net:
    """Messages between two ranks' KVMoves, delivered when the test says; notes the stream current when
    each K/V layer is sent (the sink packs it then)."""

    def __init__(self):
        self.queue = []

    def send(self, rank, msg):
        if isinstance(msg, wire.KVLayer):
            _Stream.log.append(("send", torch.cuda.current_stream().name))
        self.queue.append((rank, msg))

    def deliver(self, moves):
        queue, self.queue = self.queue, []
        for rank, msg in queue:
            moves[rank].handle(msg)


def test_only_a_kv_handoff_engine_is_wrapped_as_one(fake_cuda):
    """The worker streams a component's sequences only where its engine is a `KVHandoff`
    (`KVMoves.start`): wrapping must keep that, and add it to nothing else."""
    cuda = torch.device("cuda", 0)
    ar = on_own_stream(lambda: make_engine(TinyLM()), cuda)
    stateless = on_own_stream(lambda: StatelessEngine(_Double()), cuda)
    assert type(ar) is KVOwnStreamEngine and isinstance(ar, KVHandoff)
    assert type(stateless) is OwnStreamEngine and not isinstance(stateless, KVHandoff)
    net = _Net()
    moves = KVMoves(0, {"llm": ar, "double": stateless}, net.send, LocalCodec(), lambda t: t)
    moves.start("r", {"llm": 1, "double": 1})
    assert not moves.submit("double", StepItem("r", "w", "double", {"x": torch.ones(1)}))
    assert moves.submit("llm", StepItem("r", "prefill", "llm", {"input_ids": torch.tensor([1, 2, 3])}, GREEDY))
    ((rank, offer),) = net.queue
    assert rank == 1 and isinstance(offer, wire.KVOffer) and offer.tokens == [1, 2, 3]


def test_a_sequence_moves_between_engines_on_their_own_streams_in_stream_order(fake_cuda):
    """Prefill on one wrapped engine, decode on another, through two workers' KVMoves: the tokens of one
    bare engine, no prompt token computed by the receiver; each layer is sent with the worker's stream
    current after it waited for the sender's stream, and written into the receiver's cache on its own
    stream after that stream waited for the worker's (the module doc says why). The copies and
    `record_stream` calls of CUDA tensors run in tests/gpu/test_pd_own_stream_gpu.py."""
    model, prompt = TinyLM(), prompts(8)[-1]
    bare = make_engine(model)
    bare.submit(StepItem("r", "prefill", "llm", {"input_ids": torch.tensor(prompt)}, GREEDY))
    (first,) = bare.step()
    bare.submit(StepItem("r", "decode", "llm", {"input_ids": first.outputs["token"]}, GREEDY, loop=LoopSpec(5)))
    want = [int(r.outputs["token"]) for r in [first, *_drain(bare)]]

    cuda = torch.device("cuda", 0)
    a = KVOwnStreamEngine(make_engine(model, max_batch_tokens=8), cuda, _Stream(name="a"))
    b = KVOwnStreamEngine(_Noted(model, KVCacheConfig(max_num_pages=64, page_size=4), "cpu",
                                 default_sampling=SamplingParams(temperature=0.0)), cuda, _Stream(name="b"))
    net = _Net()
    moves = {r: KVMoves(r, {"llm": e}, net.send, LocalCodec(), lambda t: t) for r, e in ((0, a), (1, b))}
    moves[0].start("r", {"llm": 1})
    assert moves[0].submit("llm", StepItem("r", "prefill", "llm", {"input_ids": torch.tensor(prompt)}, GREEDY))
    net.deliver(moves)  # the offer: b reserves
    net.deliver(moves)  # the accept: a streams
    results = []
    while a.has_work():
        results += a.step()
        net.deliver(moves)
    (result,) = results
    decode = StepItem("r", "decode", "llm", {"input_ids": result.outputs["token"], "prompt_ids": torch.tensor(prompt)},
                      GREEDY, loop=LoopSpec(5))
    assert moves[1].submit("llm", decode)
    assert [int(r.outputs["token"]) for r in [result, *_drain(b)]] == want
    assert b.stats()["prompt_tokens"] == 0 and b.stats()["kv_pages_received"] == 8

    log = _Stream.log
    sends, places = [i for i, e in enumerate(log) if e[0] == "send"], [i for i, e in enumerate(log) if e[0] == "place"]
    assert len(sends) == len(places) == LAYERS * 4  # four chunks of 8 tokens, every layer of each
    for i in sends:
        assert log[i] == ("send", "worker") and log[i - 1] == ("wait", "worker", "a")
    for i in places:
        assert log[i] == ("place", "b") and log[i - 1] == ("wait", "b", "worker")


def _drain(engine) -> list:
    results = []
    while engine.has_work():
        results += engine.step()
    return results
