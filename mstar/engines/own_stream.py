"""An engine stepped on a CUDA stream of its own, beside the worker's other engines.

A worker steps its engines one after another from one thread, and on one stream their kernels run one
after another too. A component that declares `own_stream` (engine option; Qwen3-Omni's thinker) gets
a stream of its own: its queued work (a decode forward launched ahead, `lookahead.py`) then runs while
the worker steps the others (the talk loop), instead of in front of them.

Ordering, in both directions:
- into the engine: each step first makes its stream wait for all work queued so far on the worker's
  stream (the producers of its inputs, the host copies `submit` queued), and every CUDA input is
  recorded as used on its stream, so the caching allocator does not hand its block out while the
  engine may still read it;
- out of it: a step returns results only after the host has waited for them (the engine's host sync
  on its sampled ids, which follows every output it returns), so kernels the worker launches later on
  any stream see them; each CUDA output is recorded as used on the worker's stream, so its block is
  not reused on this stream while a consumer there may still read it.

Memory that kernels keep between launches is not shared with the other engines, whose kernels now run
at the same time: the engine is built (its graphs captured, its kernels warmed up and timed) and
stepped inside `scratch_owner(stream)` (`kernels/scratch.py`), so its split-K workspaces and tile
counters are its own, and its CUDA graphs are captured on its stream, not on the capture stream the
other engines' graphs share (`BatchGraphs`: cuBLAS workspaces are kept per stream).

An engine that moves sequences between workers (`KVHandoff`, prefill/decode disaggregation) is wrapped
as one (`KVOwnStreamEngine`) and orders each call that touches the device:
- sending: its layer tap gathers a layer's K/V inside the step, on this stream; the sink is called as
  from a bare engine, with the worker's stream current after it waited for this one and each tensor
  recorded as used there, since an in-process receiver reads the tensor itself on its worker's stream (a
  CUDA IPC pack, which clones and records its event on the current stream, is ordered either way);
- receiving: `place_kv`'s K/V are ready on the worker's stream and are copied there into blocks of this
  process's allocator, recorded as used on this stream (a CUDA IPC mapping is not the allocator's:
  `record_stream` skips it, and its free synchronizes only the then-current stream); this stream waits
  for the worker's and writes them into the cache behind its queued forwards, which may still write the
  pages just reserved (a sequence that stopped while its next forward was launched ahead);
- `submit_streamed` and `submit_with_kv` record their inputs as `submit` does; the rest queue no device work.

The rest of the `Engine` contract (has_work, release, stats, last_step_items) is the wrapped engine's;
anything else is reached through `engine`. Off CUDA the engine is not wrapped (`on_own_stream`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from mstar.engines.base import Engine, StepItem, StepResult
from mstar.engines.kv_handoff import (
    WHOLE_POOL,
    KVGranted,
    KVHandoff,
    KVOffer,
    KVStreamEnd,
    KVStreamSink,
    KVWithdrawn,
)
from mstar.kernels.scratch import scratch_owner


class OwnStreamEngine:
    """`engine` with every step on `stream` (see the module doc); build it with `on_own_stream`."""

    def __init__(self, engine: Engine, device: torch.device, stream: Any) -> None:
        self.engine, self.device, self.stream = engine, device, stream
        self.host_inputs = engine.host_inputs

    @property
    def last_step_items(self) -> int:
        return self.engine.last_step_items

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def submit(self, item: StepItem) -> None:
        self._record_inputs(item)
        self.engine.submit(item)

    def step(self) -> list[StepResult]:
        worker_stream = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(worker_stream)
        with self._on_stream():
            results = self.engine.step()
        for result in results:
            for value in result.outputs.values():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(worker_stream)
        return results

    def has_work(self) -> bool:
        return self.engine.has_work()

    def release(self, request_id: str) -> None:
        self.engine.release(request_id)

    def _record_inputs(self, item: StepItem) -> None:
        for value in item.inputs.values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(self.stream)

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """The engine's work goes to its stream, its kernels' scratch is its own."""
        with torch.cuda.stream(self.stream), scratch_owner(self.stream):
            yield


class KVEngine(Engine, KVHandoff, Protocol):
    """An engine whose sequences can move between workers: what `KVOwnStreamEngine` wraps."""


class KVOwnStreamEngine(OwnStreamEngine):
    """An `OwnStreamEngine` around a `KVHandoff` engine, itself a `KVHandoff`: each call goes to `engine`,
    ordered with its stream as the module doc says."""

    engine: KVEngine

    def __init__(self, engine: KVEngine, device: torch.device, stream: Any) -> None:
        super().__init__(engine, device, stream)

    def submit_streamed(self, item: StepItem, sink: KVStreamSink) -> KVOffer | None:
        """`KVHandoff.submit_streamed`; `sink` is called on the worker's stream (module doc)."""
        self._record_inputs(item)
        worker_stream = torch.cuda.current_stream(self.device)
        return self.engine.submit_streamed(item, _WorkerStreamSink(sink, worker_stream, self.stream))

    def stream_kv(self, request_id: str, kv_slot: str, skip: int | None, declined: str = WHOLE_POOL) -> None:
        """`KVHandoff.stream_kv`."""
        self.engine.stream_kv(request_id, kv_slot, skip, declined)

    def reserve_kv(self, request_id: str, kv_slot: str, offer: KVOffer, granted: KVGranted,
                   withdrawn: KVWithdrawn) -> bool:
        """`KVHandoff.reserve_kv`."""
        return self.engine.reserve_kv(request_id, kv_slot, offer, granted, withdrawn)

    def expire_kv(self, now: float) -> None:
        """`KVHandoff.expire_kv`."""
        self.engine.expire_kv(now)

    def place_kv(self, request_id: str, kv_slot: str, layer: int, start: int, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """`KVHandoff.place_kv`, written into the cache on the engine's stream (module doc)."""
        worker_stream = torch.cuda.current_stream(self.device)
        if k.is_cuda:
            k, v = k.clone(), v.clone()  # blocks of this process's allocator, whatever the transport made
            k.record_stream(self.stream)
            v.record_stream(self.stream)
        self.stream.wait_stream(worker_stream)
        with self._on_stream():
            self.engine.place_kv(request_id, kv_slot, layer, start, k, v)

    def submit_with_kv(self, item: StepItem, done: KVStreamEnd | None) -> None:
        """`KVHandoff.submit_with_kv`."""
        self._record_inputs(item)
        self.engine.submit_with_kv(item, done)


class _WorkerStreamSink:
    """The `KVStreamSink` a wrapped engine calls on its own stream (inside its step): `sink` is called as
    from a bare engine, on the worker's stream, with the K/V ready there (module doc)."""

    def __init__(self, sink: KVStreamSink, worker_stream: Any, own_stream: Any) -> None:
        self.sink, self.worker_stream, self.own_stream = sink, worker_stream, own_stream

    def layer(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.worker_stream.wait_stream(self.own_stream)
        for t in (k, v):
            if t.is_cuda:
                t.record_stream(self.worker_stream)
        with torch.cuda.stream(self.worker_stream):
            self.sink.layer(layer, start, k, v)

    def end(self, done: KVStreamEnd) -> None:
        self.sink.end(done)


def on_own_stream(make: Callable[[], Engine], device: torch.device) -> Engine:
    """The engine `make()` builds, on a stream of its own on a CUDA device (built inside its scratch
    scope: module doc), as a `KVHandoff` when it is one; elsewhere `make()` as it is."""
    if device.type != "cuda":
        return make()
    stream = torch.cuda.Stream(device)
    with scratch_owner(stream):
        engine = make()
    if isinstance(engine, KVHandoff):
        return KVOwnStreamEngine(engine, device, stream)  # type: ignore[arg-type,return-value]
    return OwnStreamEngine(engine, device, stream)  # type: ignore[return-value]
