"""CUDA graphs over a batch dimension: capture a function at a few batch sizes, replay it padded.

On a slow host, launching a decoder's few hundred kernels one by one costs more than the GPU
work itself; replaying a captured graph costs one launch. `BatchGraphs` is the one facility for
this: the autoregressive engine captures its decode step with it, and the stateless engine the
fixed-shape functions its components declare (`StatelessComponent.capture_plans`).

Contract for a function `fn(*inputs) -> Tensor | tuple[Tensor, ...]` to be captured:
- every input and output has the batch as dimension 0, and the other dimensions are fixed;
- it launches GPU work only: no host syncs (`.item()`, `.tolist()`, data-dependent shapes) and no
  CPU tensors created from data; state it reads besides its inputs (a KV cache, an attention
  backend's metadata buffers) lives in persistent tensors that are updated in place between calls;
- padded rows (batch rows beyond the real ones) must be harmless: their outputs are dropped.

`to_device_async` is how host data reaches such steps: a pageable host-to-device copy first waits for
all the work queued on the stream (the step just launched included); a pinned one does not.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence

import torch

from mstar.kernels.scratch import current_owner

logger = logging.getLogger(__name__)

GraphFn = Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]


def to_device_async(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; a host tensor goes to a CUDA device through pinned memory, without waiting for
    the work already queued there (the pinned block is reused only once the copy is done)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor that a copy of CUDA tensor `t` is queued into; valid once an event recorded
    after this call completes (the caller records and waits on it)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


class _Captured:
    """One graph with its static inputs and outputs, for one batch size."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list[torch.Tensor], outputs: tuple[torch.Tensor, ...]):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class BatchGraphs:
    """Graphs of `fn` captured at `sizes` (batch sizes) that replay any batch up to the largest one.

    `example` gives one row of each input (shape without the batch dimension, dtype). `before_capture`
    (optional) is called with the batch size just before each warm-up and capture, so state outside
    the inputs (an attention backend's buffers) can describe a valid batch of that size.
    Outputs of `__call__` are views into static buffers: valid until the next call.

    `static_inputs` (optional, one entry per input, None for "allocate one per size") gives tensors of
    at least `max(sizes)` rows that every size reads its first rows of: a caller that writes a step's
    inputs there itself (one packed copy for several inputs) passes those rows to `__call__`, which
    then copies nothing. Sizes never replay concurrently (one stream), so sharing is safe.

    `lazy`: nothing is captured up front; a size is captured (warm-up and capture, a few calls of `fn`)
    the first time a batch runs in it: for functions that are costly to capture at sizes that may never
    come, such as a DiT forward per exact batch size. `pool` (a `torch.cuda.graph_pool_handle()`) lets
    several BatchGraphs share one memory pool; like the sizes of one BatchGraphs they must then never
    replay concurrently, and each call's outputs must be consumed before any of them replays again.

    Graphs are captured on PyTorch's shared capture stream, or, inside `scratch_owner(stream)` (an
    engine built to step on a stream of its own, `engines/own_stream.py`), on that stream: PyTorch keeps
    a cuBLAS workspace per (handle, stream), so graphs captured on one stream may share one (see
    pytorch/pytorch#193402), and graphs of two engines replayed side by side on two streams must not.
    """

    def __init__(self, fn: GraphFn, sizes: Sequence[int], example: Sequence[tuple[tuple[int, ...], torch.dtype]],
                 device: torch.device, before_capture: Callable[[int], None] | None = None,
                 warmup: int = 2, static_inputs: Sequence[torch.Tensor | None] | None = None,
                 lazy: bool = False, pool: tuple[int, int] | None = None) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.fn, self.device, self.example = fn, device, list(example)
        self.sizes = sorted(set(sizes))
        self._shared = _check_shared(static_inputs, self.example, self.sizes[-1], device)
        self._before = before_capture or (lambda size: None)
        self._graphs: dict[int, _Captured] = {}
        self._pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self._warmup = warmup
        if lazy:
            return
        started = time.perf_counter()
        # Largest first: smaller graphs reuse the memory the largest one reserved in the shared pool.
        for size in reversed(self.sizes):
            self._graphs[size] = self._capture(size, warmup)
            logger.debug("captured %s at batch %d (%.1f s so far)", _name(fn), size, time.perf_counter() - started)
        logger.info("captured %d CUDA graphs of %s for batch sizes %s in %.1f s", len(self.sizes), _name(fn),
                    self.sizes, time.perf_counter() - started)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    @property
    def captured_sizes(self) -> list[int]:
        """The sizes captured so far (all of `sizes` unless lazy), ascending."""
        return sorted(self._graphs)

    def bucket(self, batch: int) -> int | None:
        """The captured size a batch of `batch` rows runs in (None: too large, run eagerly)."""
        return next((s for s in self.sizes if s >= batch), None)

    def _capture(self, size: int, warmup: int) -> _Captured:
        inputs = [torch.zeros((size, *shape), dtype=dtype, device=self.device) if shared is None else shared[:size]
                  for (shape, dtype), shared in zip(self.example, self._shared)]
        self._before(size)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up (lazy init, autotuning) outside the capture
            for _ in range(warmup):
                self.fn(*inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        owner = current_owner()  # a stream of its own (class doc), else PyTorch's shared capture stream
        stream = owner if isinstance(owner, torch.cuda.Stream) else None
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            out = self.fn(*inputs)
        outputs = out if isinstance(out, tuple) else (out,)
        return _Captured(graph, inputs, outputs)

    def __call__(self, *inputs: torch.Tensor, bucket: int | None = None) -> tuple[torch.Tensor, ...]:
        """Replay with `inputs` (batch B <= max_batch); returns each output's first B rows.

        `bucket` picks the captured size (it must hold B); the caller passes it when state outside the
        inputs was already padded for that size. Padded input rows are left as they were. An input that
        is the first rows of its static input (see `static_inputs`) is already in place: not copied.
        """
        batch = inputs[0].shape[0]
        size = bucket or self.bucket(batch)
        if size is None or size < batch:
            raise ValueError(f"batch {batch} does not fit the captured sizes {self.sizes}")
        # graphs captured under inference mode have inference-tensor inputs, which only take in-place
        # updates inside it (a caller under no_grad, as stateless components run, would raise)
        with torch.inference_mode():
            captured = self._graphs.get(size)
            if captured is None:  # lazy: this size's first batch
                started = time.perf_counter()
                captured = self._graphs[size] = self._capture(size, self._warmup)
                logger.info("captured a CUDA graph of %s at batch %d in %.2f s", _name(self.fn), size,
                            time.perf_counter() - started)
            for static, value in zip(captured.inputs, inputs):
                if value.data_ptr() != static.data_ptr():
                    static[:batch].copy_(value, non_blocking=True)
            captured.graph.replay()
        return tuple(o[:batch] for o in captured.outputs)


def _name(fn: GraphFn) -> str:
    """What a log line calls a captured function: its owner's class and its name (a partial's function's)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{type(owner).__name__}.{fn.__name__}" if owner is not None else name


def _check_shared(shared: Sequence[torch.Tensor | None] | None, example: list[tuple[tuple[int, ...], torch.dtype]],
                  rows: int, device: torch.device) -> list[torch.Tensor | None]:
    """`static_inputs` as a list (Nones when not given), each checked against its input's example."""
    if shared is None:
        return [None] * len(example)
    if len(shared) != len(example):
        raise ValueError(f"{len(shared)} static inputs for {len(example)} inputs")
    if device.type == "cuda" and device.index is None:  # "cuda" names the current device, as tensors say
        device = torch.device("cuda", torch.cuda.current_device())
    for t, (shape, dtype) in zip(shared, example):
        if t is not None and (t.shape[0] < rows or tuple(t.shape[1:]) != tuple(shape) or t.dtype != dtype
                              or t.device != device or not t.is_contiguous()):
            raise ValueError(f"static input {tuple(t.shape)} {t.dtype} on {t.device} does not hold {rows} "
                             f"contiguous rows of {tuple(shape)} {dtype} on {device}")
    return list(shared)
