"""The seam between a worker and the engines that run its components.

A worker hands an engine one `StepItem` per (request, node) whose inputs are ready; the engine
batches pending items across requests as it sees fit and returns one `StepResult` per item it
finished in that step. Items it did not finish stay pending inside the engine.

An item of an engine loop (`StepItem.loop`, see `ModelGraph.engine_loop`) is the whole loop: the
engine runs its iterations itself, each fed the token the last one sampled, and returns one result
per iteration; all but the last have `more=True`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import torch

from mstar.engines.grammar import Grammars


@dataclass(frozen=True, slots=True)
class LoopSpec:
    """An engine loop handed to its engine as one item: at most `max_iterations` (>= 1) iterations, the
    first fed the item's inputs, each later one the token the one before sampled (ports
    `graph.SAMPLED_PORT` -> `graph.FED_PORT`); the item's other inputs are read once, at the first."""

    max_iterations: int


@dataclass(slots=True)  # one per item and step: slots make them cheaper to build and read
class StepItem:
    """One node of one request, ready to run."""

    request_id: str  # the request this work belongs to
    walk: str  # the walk the node sits in (a component may behave per walk)
    node: str  # the node's name inside the walk
    # component input port -> tensor: on the engine's device, or as produced when the engine sets
    # `host_inputs = True` (it reads them on the host, e.g. token ids)
    inputs: dict[str, torch.Tensor]
    options: dict[str, Any] = field(default_factory=dict)  # per-request model options (sampling, ...)
    iteration: int = 0  # loop iteration the item belongs to (0 outside loops)
    kv_slot: str = "main"  # which KV sequence of the request (guidance branches use several)
    loop: LoopSpec | None = None  # set: the item is an engine loop (module docstring)


@dataclass(slots=True)
class StepResult:
    """What one item produced."""

    request_id: str
    walk: str
    node: str
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # component output port -> tensor
    stop: bool = False  # ask the enclosing Loop to end after this iteration
    error: str | None = None  # set when this item failed; the request fails alone
    iteration: int = 0
    finish_reason: str | None = None  # why the request's generation ended ("stop", "length"), if it did
    more: bool = False  # an engine loop's iteration that does not end it: its item stays pending


class Engine(Protocol):
    """Runs one component for many requests.

    Contract: `submit` never blocks and never runs the model; `step` runs at most one batched
    execution and returns results for the items it finished (possibly none, possibly items
    submitted in earlier calls) and for the iterations of engine-loop items it ran (`more=True`
    but the last); `release` drops every trace of a request (cache pages, pending items) and is
    safe to call for unknown requests. Only the autoregressive engine takes engine-loop items.

    `host_inputs`: the worker hands item inputs over as they came (host tensors stay on the host)
    instead of copying them to the engine's device. `last_step_items`: the items (sequences, batch
    rows) the latest `step` computed, 0 when it ran nothing. `stats()`: cheap load counters for
    /metrics (no device sync; the worker calls it about twice a second). Keys the server knows
    (docs/metrics.md names the series they become): queue_depth (items submitted and not yet
    answered), kv_pages_used (held by live sequences), kv_pages_cached (of finished sequences, kept
    for prefix reuse, free to evict), kv_pages_total, seqs_running (holding KV pages), seqs_waiting
    (for pages, new or preempted), preemptions (since start, a counter); counters of prefill/decode
    disaggregation: prompt_tokens (prompt tokens computed), kv_pages_sent, kv_pages_received,
    kv_pages_reused (pages of a moved sequence its prefix cache held).
    """

    host_inputs: bool
    last_step_items: int

    def submit(self, item: StepItem) -> None: ...

    def step(self) -> list[StepResult]: ...

    def has_work(self) -> bool: ...

    def release(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class AutoregressiveSpec:
    """How the autoregressive engine runs one component: what the model fixes (`eos_token_ids`,
    `max_model_len`) and the engine settings (the fields marked tunable, `tunable()`), whose model
    defaults a deployment overrides per component in the YAML `engines:` section."""

    eos_token_ids: tuple[int, ...] = ()  # ids that end a sequence
    max_model_len: int | None = None  # tokens one sequence may hold; None: what the KV pool holds
    max_num_seqs: int = field(default=256, metadata={"tunable": True})  # sequences batched together at most
    max_batch_tokens: int = field(default=2048, metadata={"tunable": True})  # tokens per step (prefill chunks)
    enable_prefix_caching: bool = field(default=True, metadata={"tunable": True})
    # the KV pool: `max_num_pages` pages, else this share of the device memory free once every component of
    # the worker is built (None: kv_cache.memory_fraction, split over the device's autoregressive
    # components in proportion to their page sizes, so each holds as many tokens); either overrides kv_cache's
    max_num_pages: int | None = field(default=None, metadata={"tunable": True})
    memory_fraction: float | None = field(default=None, metadata={"tunable": True})
    # batch sizes of the decode CUDA graphs; None: cuda_graphs' (batch_sizes, or up to max_batch_size)
    cuda_graph_sizes: list[int] | None = field(default=None, metadata={"tunable": True})
    own_stream: bool = field(default=False, metadata={"tunable": True})  # step on a CUDA stream of its own (own_stream.py)
    # prefill/decode disaggregation: how long a sequence offered to this engine (a decode worker's) may wait
    # for free pages before the offer is declined (docs/operations.md gives the default's reason)
    kv_offer_timeout_s: float = field(default=60.0, metadata={"tunable": True})
    # structured outputs: makes the grammar matcher of each request that sets `structured_outputs`
    # (engines/grammar.py); None: such requests fail
    grammars: Grammars | None = None

    def __post_init__(self) -> None:
        for name, value in (("max_num_seqs", self.max_num_seqs), ("max_batch_tokens", self.max_batch_tokens)):
            if not _positive_int(value):
                raise ValueError(f"{name}={value!r}: use a positive integer")
        if self.max_num_pages is not None and not _positive_int(self.max_num_pages):
            raise ValueError(f"max_num_pages={self.max_num_pages!r}: use a positive integer or leave it unset")
        if self.memory_fraction is not None and not (
                isinstance(self.memory_fraction, int | float) and 0.0 < self.memory_fraction <= 1.0):
            raise ValueError(f"memory_fraction={self.memory_fraction!r}: use a number in (0, 1] or leave it unset")
        if self.cuda_graph_sizes is not None and (
                not self.cuda_graph_sizes or not all(_positive_int(s) for s in self.cuda_graph_sizes)):
            raise ValueError(f"cuda_graph_sizes={self.cuda_graph_sizes!r}: use a list of positive integers")
        timeout = self.kv_offer_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"kv_offer_timeout_s={timeout!r}: use a positive number of seconds")


@dataclass(frozen=True)
class KVPoolSpec:
    """A paged KV pool that a stateless component keeps contexts of its own in (BAGEL's LLM): the stateless
    engine makes it (`PagedKVStore`) and hands it over once (`KVPoolComponent.set_kv_pool`); the memory
    plan counts `nbytes()`. `setting` names where a deployment sizes it (for messages)."""

    layout: KVLayout
    num_pages: int
    setting: str  # e.g. "model_kwargs.kv_tokens"
    page_size: int = 16  # tokens per page
    max_rows: int = 64  # decode rows of one call at most (the attention backend's persistent buffers)
    attention_backend: str = "auto"  # as kv_cache.attention_backend

    def __post_init__(self) -> None:
        if not _positive_int(self.num_pages) or not _positive_int(self.page_size) or not _positive_int(self.max_rows):
            raise ValueError(f"KVPoolSpec needs positive num_pages, page_size and max_rows, got {self.num_pages}, "
                             f"{self.page_size}, {self.max_rows} ({self.setting})")

    def page_bytes(self) -> int:
        """Bytes one page takes across all layers, K and V together."""
        itemsize = torch.empty((), dtype=self.layout.dtype).element_size()
        return 2 * self.layout.num_layers * self.page_size * self.layout.num_kv_heads * self.layout.head_dim * itemsize

    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes()


@runtime_checkable
class PagedKVStore(Protocol):
    """What a component sees of its `KVPoolSpec` pool: pages handed out and shared by reference count
    (`allocate`, `share`: one more holder of pages already held, `free`: one holder fewer), the caches
    `k_cache`/`v_cache` [num_layers, pages, page_size, Hkv, D] it reads and writes by page, and attention of
    decode rows in place: `prepare_decode` describes a batch of one new token per row (each row's length
    with that token, its slot page * page_size + offset, its pages [B, W] int32; host or device tensors),
    then `decode(layer, q [B, Hq, D], k/v [B, Hkv, D])` stores each row's k/v at its slot and attends q over
    the row's keys -> [B, Hq, D]. `graphed`: `decode` can be captured in CUDA graphs; `prepare_decode(...,
    pad_to=rows)` then pads the batch to `rows` (length 0, slot -1: nothing stored, zeros out) in buffers of
    fixed addresses, as a graph captured at `rows` rows reads them."""

    page_size: int
    graphed: bool
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @property
    def num_free(self) -> int: ...

    def allocate(self, n: int) -> list[int]: ...

    def share(self, pages: Sequence[int]) -> None: ...

    def free(self, pages: Sequence[int]) -> None: ...

    def prepare_decode(self, seq_lens: list[int], slots: torch.Tensor, block_tables: torch.Tensor,
                       pad_to: int | None = None) -> None: ...

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class GraphBufferSpec:
    """Buffers a stateless component allocates when its engine captures its `capture_plans` (caches its graphs
    write and read, such as V-JEPA 2-AC's rollout and candidate caches), beyond its weights and the graphs'
    own pool: the memory plan counts `nbytes` where graphs are captured. `setting` names where a deployment
    sizes them (for messages)."""

    nbytes: int
    setting: str  # e.g. "model_kwargs.plan_graph_samples"

    def __post_init__(self) -> None:
        if not isinstance(self.nbytes, int) or isinstance(self.nbytes, bool) or self.nbytes < 0:
            raise ValueError(f"GraphBufferSpec needs nbytes >= 0, got {self.nbytes!r} ({self.setting})")


@dataclass(frozen=True)
class StatelessSpec:
    """How the stateless engine runs one component (tunable fields as in `AutoregressiveSpec`)."""

    max_batch_size: int = field(default=64, metadata={"tunable": True})  # items batched into one call at most
    # batch sizes at which the engine captures the component's `capture_plans` on CUDA; None: powers of
    # two below max_batch_size, and it
    cuda_graph_sizes: list[int] | None = field(default=None, metadata={"tunable": True})
    # a paged KV pool the engine makes for the component (a `KVPoolComponent`); None: none
    kv_pool: KVPoolSpec | None = None
    # buffers the component allocates for its captured graphs (counted by the memory plan); None: none
    graph_buffers: GraphBufferSpec | None = None

    def __post_init__(self) -> None:
        if not _positive_int(self.max_batch_size):
            raise ValueError(f"max_batch_size={self.max_batch_size!r}: use a positive integer")
        if self.cuda_graph_sizes is not None and (
                not self.cuda_graph_sizes or not all(_positive_int(s) for s in self.cuda_graph_sizes)):
            raise ValueError(f"cuda_graph_sizes={self.cuda_graph_sizes!r}: use a list of positive integers")

    def graph_sizes(self) -> list[int]:
        """The batch sizes to capture, ascending, none above `max_batch_size` (a batch never holds more)."""
        if self.cuda_graph_sizes is not None:
            return sorted({s for s in self.cuda_graph_sizes if s <= self.max_batch_size}) or [self.max_batch_size]
        sizes, size = [], 1
        while size < self.max_batch_size:
            sizes.append(size)
            size *= 2
        return [*sizes, self.max_batch_size]


@dataclass(frozen=True)
class CapturePlan:
    """A fixed-shape function of a stateless component that its engine captures in CUDA graphs, one per
    batch size (`cuda_graphs.BatchGraphs` states what such a function may do). `example` gives one row of
    each input: (shape without the batch dimension, dtype). The component replays it by `key`
    (`StepGraphs.replay`). `sizes`: the batch sizes this plan is captured at when its batch counts
    something other than the engine's items (a search's candidates); None: the engine's `graph_sizes()`."""

    key: Hashable
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
    example: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    sizes: tuple[int, ...] | None = None
    # called with the batch size before each size's warm-up and capture, so that state `fn` reads besides
    # its inputs (an attention backend's buffers) describes a valid batch of that size; None: nothing
    before_capture: Callable[[int], None] | None = None


SPEC_OF_ENGINE: dict[str, type[AutoregressiveSpec] | type[StatelessSpec]] = {
    "autoregressive": AutoregressiveSpec, "stateless": StatelessSpec}  # ComponentSpec.engine -> its spec


def tunable(spec: type[AutoregressiveSpec] | type[StatelessSpec]) -> tuple[str, ...]:
    """The fields of `spec` a deployment may set per component (YAML `engines.<component>`)."""
    return tuple(f.name for f in fields(spec) if f.metadata.get("tunable"))


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@runtime_checkable
class StatelessComponent(Protocol):
    """What the stateless engine runs (`StatelessBase` gives every member but `run_batch` a default).

    `run_items(items)` computes one batched call: one output dict (port -> tensor, plus an optional
    "stop" bool that ends the enclosing loop) per item. `batch_key(item)`: which pending items may
    share one call (a DiT batches guidance branches and requests whose latent shapes match, whatever
    node or iteration each belongs to). `release(request_id)`: drop per-request state, called when
    the engine releases the request. `host_inputs`: inputs arrive as produced (host tensors stay on
    the host). `host_outputs`: outputs are wanted on the host (audio for the client); on CUDA the
    engine queues their copies into pinned memory and hands the results out at a later step, once
    they are done. `side_stream` (with both, for a CUDA module): its steps run on a CUDA stream of
    their own, overlapping the other components' kernels (engines/stateless.py says why it is safe).
    `capture_plans()`: the fixed-shape functions the engine captures in CUDA graphs when it is made on
    a CUDA device (none: the component runs eagerly); it sets `graphs` to them, and `run_items`
    replays one with `self.graphs.replay(key, *inputs)`, falling back to eager code when that
    returns None (no graph, or a batch larger than the largest captured size).
    """

    host_inputs: bool
    host_outputs: bool
    side_stream: bool
    graphs: StepGraphs

    def run_items(self, items: list[StepItem]) -> list[dict[str, Any]]: ...

    def batch_key(self, item: StepItem) -> Hashable: ...

    def release(self, request_id: str) -> None: ...

    def capture_plans(self) -> Sequence[CapturePlan]: ...


@runtime_checkable
class KVPoolComponent(StatelessComponent, Protocol):
    """A stateless component whose spec declares a `kv_pool`: given the pool its engine made, once,
    before its first step. `kv_pages(item)`: the pages the request of `item` holds in the pool at most,
    over its whole life (every context it keeps here, at full length), when `item` is the request's first
    to take pages (0 for items that take none). The engine promises a request that many pages when its
    first such item runs and keeps the promise until the request is released: an item whose request does
    not fit what is unpromised waits, and one that no pool of this size holds fails alone."""

    def set_kv_pool(self, pool: PagedKVStore) -> None: ...

    def kv_pages(self, item: StepItem) -> int: ...


@runtime_checkable
class SequenceParallelComponent(StatelessComponent, Protocol):
    """A stateless component that splits its work over the ranks of a sequence-parallel replica
    (`ComponentSpec.sequence_parallel`): given the replica's process group before its first step."""

    def set_sp_group(self, group: Any) -> None: ...


class StepGraphs:
    """A stateless component's captured functions by `CapturePlan.key` (empty until its engine captures
    them: `engines.stateless.capture_step_graphs`)."""

    def __init__(self, graphs: dict[Hashable, Any] | None = None) -> None:
        self._graphs = dict(graphs or {})  # key -> cuda_graphs.BatchGraphs

    def __bool__(self) -> bool:
        return bool(self._graphs)

    def keys(self) -> list[Hashable]:
        return list(self._graphs)

    def sizes(self, key: Hashable) -> list[int]:
        """The batch sizes captured for `key`, ascending."""
        return list(self._graphs[key].sizes)

    def replay(self, key: Hashable, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """`key`'s function over `inputs` (batch first) replayed from its graph: its outputs' first rows,
        views of the graphs' buffers that the next replay of any key overwrites (copy what is kept);
        None when `key` has no graph or the batch is larger than its largest size (run it eagerly)."""
        graphs = self._graphs.get(key)
        if graphs is None or inputs[0].shape[0] > graphs.max_batch:
            return None
        return graphs(*inputs)


class StatelessBase:
    """Defaults of `StatelessComponent`: a subclass implements `run_batch` (or overrides `run_items`
    when it needs the request ids or node names of a mixed batch) and what else differs."""

    host_inputs = False
    host_outputs = False
    side_stream = False
    graphs = StepGraphs()  # none until its engine captures `capture_plans` (it sets a new one)

    def run_batch(self, walk: str, node: str, inputs: list[dict[str, torch.Tensor]],
                  options: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One output dict per item of a batch of the same (walk, node)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither run_batch nor run_items")

    def run_items(self, items: list[StepItem]) -> list[dict[str, Any]]:
        head = items[0]
        return self.run_batch(head.walk, head.node, [i.inputs for i in items], [i.options for i in items])

    def batch_key(self, item: StepItem) -> Hashable:
        return (item.walk, item.node)

    def release(self, request_id: str) -> None:
        pass

    def capture_plans(self) -> Sequence[CapturePlan]:
        return ()


def require(obj: object, protocol: type, hint: str = "") -> None:
    """TypeError naming what `obj` lacks when it does not implement `protocol` (checked once, at build)."""
    if isinstance(obj, protocol):
        return
    present = set(dir(obj))  # class and instance attributes (an nn.Module lists its submodules too)
    missing = [name for name in protocol_members(protocol) if name not in present]
    raise TypeError(f"{type(obj).__name__} does not implement {protocol.__name__}: it lacks "
                    f"{', '.join(missing) or '(members of the wrong kind)'}{hint}")


def protocol_members(protocol: type) -> list[str]:
    """The attributes and methods `protocol` (and the protocols it extends) declare."""
    names: dict[str, None] = {}
    for cls in reversed(protocol.__mro__):
        own = vars(cls)
        if cls is Protocol or not own.get("_is_protocol", False):
            continue
        names.update(dict.fromkeys(own.get("__annotations__", {})))
        names.update(dict.fromkeys(n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")))
    return list(names)


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache an autoregressive model needs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


@runtime_checkable
class CausalLM(Protocol):
    """What the autoregressive engine needs from a decoder model (`mstar/models/llama` implements it;
    `CausalLMBase` gives the members a plain decoder need not restate).

    `forward` takes the new tokens of a packed batch (requests one after another, as described by
    the metadata the engine gave `attn.prepare`) and returns their final hidden states [T,
    `hidden_size`]; a model with `accepts_extras` also takes `extras` (a `ForwardExtras` or None:
    input embeddings, per-token features named in `token_features`, hidden states to capture) and,
    with `multirow_positions`, positions [3, T] (M-RoPE). `compute_logits` maps the hidden states of
    the positions to sample from, with the token each was computed at (`input_ids` [N], on the same
    device: a head may score only the ids that token allows next, -inf elsewhere), to float32 logits
    [N, logit_width] over the contiguous token ids [logit_offset, logit_offset + logit_width):
    column c is token id logit_offset + c; ids outside the window are never sampled. Both are fixed
    once the engine is built (its CUDA graphs capture at that width; a resumed seeded sequence skips
    `logit_width` draws per token). `out` (float32 [N, logit_width]) is where the model may write the
    logits and return them (a hint: the engine checks what comes back and copies anything else).
    `supports_cuda_graphs()` False has the engine run decode eagerly (a MoE whose expert path syncs
    the host for this dtype); `graph_hidden_layers` are the layers whose hidden states decode graphs
    can return (`ExtrasGraphs`).
    """

    kv_layout: KVLayout
    hidden_size: int
    logit_offset: int
    logit_width: int
    accepts_extras: bool
    multirow_positions: bool
    token_features: tuple[str, ...]
    graph_hidden_layers: tuple[int, ...]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor, input_ids: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor: ...

    def supports_cuda_graphs(self) -> bool: ...


class CausalLMBase:
    """Defaults of `CausalLM` for a decoder that scores the whole vocabulary from id 0, takes token ids
    and positions [T] only and can be captured in CUDA graphs."""

    logit_offset = 0
    accepts_extras = False
    multirow_positions = False
    token_features: tuple[str, ...] = ()
    graph_hidden_layers: tuple[int, ...] = ()

    def supports_cuda_graphs(self) -> bool:
        return True
