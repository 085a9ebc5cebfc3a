"""The stateless engine: batches steps of one (walk, node) across requests.

Used by encoders, codecs, denoising steps and the toy model. A component implements
`StatelessComponent` (engines/base.py), usually by subclassing `StatelessBase` and writing

    run_batch(walk, node, inputs: list[dict[port, Tensor]], options: list[dict]) -> list[dict[port, Tensor]]

whose outputs may hold a "stop" entry (bool) to end the enclosing loop.

A component with `host_outputs` has its CUDA outputs copied to pinned host memory asynchronously:
the engine hands the results out at a later `step`, once an event says the copies are done, oldest
first, so the worker never waits on a blocking `.cpu()` for everything queued before (on a shared
worker, the LM's next decode step too). One that also has `host_inputs` and `side_stream` (a CUDA
module) runs its steps on a CUDA stream of its own, so its kernels overlap those of the other
components on the GPU (the LM's decode step on a shared worker) instead of queueing behind them.
Safe because everything such a step computed leaves through host copies whose event is recorded
on that same stream, and a step with device inputs (another component wrote them on the device's
current stream: Qwen3-Omni's codec frames) first makes its stream wait, on the GPU, for the work
queued there so far (the host never waits) and marks those inputs as used on its stream, so their
memory is not reused before its kernels have read them.

A component's `capture_plans` (fixed-shape functions) are captured in CUDA graphs by the engine when it
is made with a `CudaGraphConfig` on a CUDA device, at the spec's `graph_sizes()`, all in one memory pool
(`capture_step_graphs`); the component replays them through its `graphs`. A spec's `kv_pool` has the
engine make that paged KV pool (engines/kv_cache/paged.py) on the module's device and hand it to the
module (`KVPoolComponent.set_kv_pool`) before anything is captured, and admits requests to that pool:
each is promised the pages it will hold at most (`KVPoolComponent.kv_pages`) when its first item that
takes pages runs, until it is released. A batch takes only items whose requests were promised already or
fit what is unpromised, in arrival order (a request waiting for pages is not overtaken by later ones that
need pages, so it is not starved); the others wait in the queue. An admitted request never finds the pool
full, so requests waiting for pages wait only for admitted ones to finish. A request larger than the whole
pool fails alone.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mstar.config import CudaGraphConfig
from mstar.engines.base import (
    KVPoolComponent,
    StatelessComponent,
    StatelessSpec,
    StepGraphs,
    StepItem,
    StepResult,
    require,
)
from mstar.engines.cuda_graphs import BatchGraphs, to_host_async

if TYPE_CHECKING:
    from mstar.engines.kv_cache.paged import PagedKV

logger = logging.getLogger(__name__)


class StatelessEngine:
    """Runs the oldest pending (walk, node) group, up to `max_batch_size` requests at once.

    `graphs` (None: none) captures the module's `capture_plans` when it lives on a CUDA device and
    `graphs.enabled`; capturing happens here, before the worker reports ready.
    """

    def __init__(self, module: StatelessComponent, spec: StatelessSpec | None = None,
                 graphs: CudaGraphConfig | None = None) -> None:
        require(module, StatelessComponent, " (subclass mstar.engines.base.StatelessBase)")
        self.module = module
        spec = spec or StatelessSpec()
        self.max_batch_size = spec.max_batch_size
        device = _module_device(module)
        self._kv: _Promises | None = None
        if spec.kv_pool is not None:  # before capture: a captured step reads the pool's caches
            require(module, KVPoolComponent, f" (its spec declares a kv_pool of {spec.kv_pool.num_pages} pages)")
            from mstar.engines.kv_cache.paged import PagedKV

            pool = PagedKV(spec.kv_pool, device or torch.device("cpu"))
            module.set_kv_pool(pool)
            self._kv = _Promises(module, pool)
        if graphs is not None and graphs.enabled and device is not None and device.type == "cuda":
            capture_step_graphs(module, spec.graph_sizes(), device)
        self._pending: deque[StepItem] = deque()
        self._waiting = False  # every pending item waits for pages: nothing to step until a submit or release
        self._in_flight: deque[_InFlight] = deque()  # results whose host copies are still running
        self.host_outputs = module.host_outputs
        # the worker hands inputs over without a device copy when the component reads them on the host
        self.host_inputs = module.host_inputs
        self.stream = _side_stream(module) if self.host_inputs and self.host_outputs else None
        self.last_step_items = 0  # items the latest step ran (`Engine`)

    def submit(self, item: StepItem) -> None:
        self._pending.append(item)
        self._waiting = False

    def has_work(self) -> bool:
        return (bool(self._pending) and not self._waiting) or bool(self._in_flight)

    def release(self, request_id: str) -> None:
        self._pending = deque(i for i in self._pending if i.request_id != request_id)
        self._waiting = False
        if self._kv is not None:
            self._kv.release(request_id)
        for flight in self._in_flight:
            flight.results = [r for r in flight.results if r.request_id != request_id]
        self.module.release(request_id)

    def stats(self) -> dict[str, float]:
        """Load counters (`Engine.stats`): items waiting for a step."""
        stats = {"queue_depth": len(self._pending)}
        if self._kv is not None:
            stats.update(self._kv.stats())
        return stats

    def step(self) -> list[StepResult]:
        """Run the oldest pending group; results of this step, or of earlier ones whose host copies
        finished (in submission order)."""
        refused = self._kv.refuse(self._pending) if self._kv is not None else []
        batch = self._take_batch()
        self._waiting = not batch and bool(self._pending)
        self.last_step_items = len(batch)
        return refused + self._run_step(batch)

    def _run_step(self, batch: list[StepItem]) -> list[StepResult]:
        if self.stream is not None and batch:
            follow_device_inputs(self.stream, batch)
            with torch.cuda.stream(self.stream):  # the host copies' event is recorded on it too
                return self._hand_out(self._run_batch(batch))
        results = self._run_batch(batch) if batch else []
        if self.host_outputs and (results or self._in_flight):
            results = self._hand_out(results)
        return results

    def _run_batch(self, batch: list[StepItem]) -> list[StepResult]:
        try:
            return self._run(batch)
        except Exception:
            if len(batch) == 1:
                logger.exception("component step failed for request %s", batch[0].request_id)
                return [_failed(batch[0])]
            # Re-run one by one so a bad request fails alone.
            return [r for item in batch for r in self._run_alone(item)]

    def _hand_out(self, results: list[StepResult]) -> list[StepResult]:
        """Queue host copies of `results`' device outputs; the results whose copies are done, in order."""
        if results:
            event = start_host_copies(results)
            if event is None and not self._in_flight:
                return results  # nothing on a device: ready now
            self._in_flight.append(_InFlight(results, event))
        ready: list[StepResult] = []
        while self._in_flight and (self._in_flight[0].event is None or self._in_flight[0].event.query()):
            ready.extend(self._in_flight.popleft().results)
        return ready

    def _take_batch(self) -> list[StepItem]:
        if not self._pending:
            return []
        key, batch, rest = None, [], deque()
        admit = self._kv.admission() if self._kv is not None else None
        for item in self._pending:
            fits = key is None or (len(batch) < self.max_batch_size and self.module.batch_key(item) == key)
            if fits and (admit is None or admit(item)):
                key = self.module.batch_key(item) if key is None else key
                batch.append(item)
            else:
                rest.append(item)
        self._pending = rest
        return batch

    def _run(self, batch: list[StepItem]) -> list[StepResult]:
        head = batch[0]
        outputs = self.module.run_items(batch)
        if len(outputs) != len(batch):
            raise RuntimeError(f"{head.node}.run_items returned {len(outputs)} results for {len(batch)} items")
        results = []
        for item, out in zip(batch, outputs):
            out = dict(out)
            stop = bool(out.pop("stop", False))
            results.append(StepResult(item.request_id, item.walk, item.node, out, stop=stop, iteration=item.iteration))
        return results

    def _run_alone(self, item: StepItem) -> list[StepResult]:
        try:
            return self._run([item])
        except Exception:
            logger.exception("component step failed for request %s", item.request_id)
            return [_failed(item)]


class _Promises:
    """The pages of a `KVPoolComponent`'s pool promised to the requests it admitted (module docstring)."""

    def __init__(self, module: KVPoolComponent, pool: PagedKV) -> None:
        self.module, self.pool, self.spec = module, pool, pool.spec
        self.promised: dict[str, int] = {}  # request -> pages it may hold
        self.waiting: set[str] = set()  # requests the latest batch left waiting for pages
        # (request, walk, node) -> kv_pages of its pending item, asked once: a waiting item is checked every step
        self.needs: dict[tuple[str, str, str], int] = {}

    def refuse(self, pending: deque[StepItem]) -> list[StepResult]:
        """Take out of `pending` the items whose requests no pool of this size holds; their failed results."""
        out = []
        for item in [i for i in pending if i.request_id not in self.promised]:
            need = self.need(item)
            if need > self.spec.num_pages:
                pending.remove(item)
                out.append(StepResult(
                    item.request_id, item.walk, item.node, iteration=item.iteration,
                    error=f"{item.node} refused: the request's contexts take {need} pages of {self.spec.page_size} "
                          f"tokens, more than the whole KV pool ({self.spec.num_pages} pages); raise "
                          f"{self.spec.setting} or shorten the request"))
        return out

    def admission(self) -> Callable[[StepItem], bool]:
        """A check for one batch, asked of the pending items in order: whether the item may run now,
        promising its request's pages when it is the first to take some. Once a request waits, later ones
        that need pages wait behind it."""
        free = self.spec.num_pages - sum(self.promised.values())
        blocked = self.waiting = set()

        def admit(item: StepItem) -> bool:
            nonlocal free
            rid = item.request_id
            if rid in self.promised:
                return True
            need = self.need(item)
            if need and (blocked or need > free):
                blocked.add(rid)
                return False
            if need:
                self.promised[rid], free = need, free - need
            return True

        return admit

    def need(self, item: StepItem) -> int:
        key = (item.request_id, item.walk, item.node)
        need = self.needs.get(key)
        if need is None:
            need = self.needs[key] = self.module.kv_pages(item)
        return need

    def release(self, request_id: str) -> None:
        self.promised.pop(request_id, None)
        self.needs = {key: need for key, need in self.needs.items() if key[0] != request_id}

    def stats(self) -> dict[str, float]:
        return {"kv_pages_total": self.spec.num_pages, "kv_pages_used": self.spec.num_pages - self.pool.num_free,
                "seqs_waiting": len(self.waiting)}


@dataclass
class _InFlight:
    """Results of one step whose outputs are being copied to the host; ready when `event` completes."""

    results: list[StepResult]
    event: Any  # torch.cuda.Event, or None when nothing was copied


def start_host_copies(results: list[StepResult]) -> Any:
    """Replace every CUDA output tensor of `results` by a pinned host tensor its copy is queued into;
    the CUDA event recorded after the copies, or None when no output was on a CUDA device.

    Outputs that are views of one contiguous tensor which they cover whole (a component that packs
    its rows' outputs into one buffer) cost one copy of that tensor: each becomes the same view of
    its host copy. Any other output is copied alone (a view of a larger buffer copies only itself).
    """
    found: list[tuple[StepResult, str, torch.Tensor]] = []
    views: dict[int, list[tuple[StepResult, str, torch.Tensor]]] = {}  # id(base) -> its views
    for result in results:
        for port, value in result.outputs.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                base = value._base
                if base is not None and base.is_contiguous():
                    views.setdefault(id(base), []).append((result, port, value))
                else:
                    found.append((result, port, value))
    if not found and not views:
        return None
    for group in views.values():
        base = group[0][2]._base
        if len(group) > 1 and sum(v.numel() for _, _, v in group) >= base.numel():
            host, offset = to_host_async(base), base.storage_offset()
            for result, port, value in group:
                result.outputs[port] = host.as_strided(value.shape, value.stride(), value.storage_offset() - offset)
        else:
            found.extend(group)
    for result, port, value in found:
        result.outputs[port] = to_host_async(value)
    event = torch.cuda.Event()
    event.record()
    return event


def follow_device_inputs(stream: torch.cuda.Stream, batch: list[StepItem]) -> None:
    """Order a side-stream step after the writes of its CUDA inputs: `stream` waits (on the GPU) for
    the work queued so far on each input device's current stream, and each CUDA input is recorded as
    used on `stream` (the caching allocator then keeps its block until `stream` has passed this point)."""
    waited: set[torch.device] = set()
    for item in batch:
        for value in item.inputs.values():
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                if value.device not in waited:
                    stream.wait_stream(torch.cuda.current_stream(value.device))
                    waited.add(value.device)
                value.record_stream(stream)


def capture_step_graphs(module: StatelessComponent, sizes: list[int], device: torch.device) -> None:
    """Capture each of `module.capture_plans()` at `sizes` (batch sizes; a plan's own `sizes` where it
    gives them) on CUDA `device`, all in one memory pool (a step replays them one after another and
    copies out what it keeps), and give them to the module as its `graphs`. Captured under inference
    mode, as components run."""
    plans = list(module.capture_plans())
    if not plans:
        return
    pool = torch.cuda.graph_pool_handle()
    with torch.inference_mode():
        captured = {plan.key: BatchGraphs(plan.fn, list(plan.sizes or sizes), plan.example, device,
                                          before_capture=plan.before_capture, pool=pool)
                    for plan in plans}
    module.graphs = StepGraphs(captured)


def _module_device(module: StatelessComponent) -> torch.device | None:
    """The device of a module's first buffer or parameter (None: not a torch module, or it holds none)."""
    if not isinstance(module, torch.nn.Module):
        return None
    tensor = next(iter(module.buffers()), None)
    tensor = tensor if tensor is not None else next(iter(module.parameters()), None)
    return None if tensor is None else tensor.device


def _side_stream(module: StatelessComponent) -> torch.cuda.Stream | None:
    """A stream of its own for a module that declares `side_stream` and lives on a CUDA device."""
    device = _module_device(module) if module.side_stream else None
    return torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None


def _failed(item: StepItem) -> StepResult:
    import sys

    exc = sys.exc_info()[1]
    return StepResult(
        item.request_id, item.walk, item.node, error=f"{item.node} failed: {type(exc).__name__}: {exc}",
        iteration=item.iteration,
    )
