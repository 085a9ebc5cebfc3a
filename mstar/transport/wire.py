"""The runtime's message catalogue: typed msgspec structs, never pickle.

Tensor fields hold whatever the process's tensor codec produces: torch tensors themselves in
in-process mode (nothing is encoded), payloads across processes (`AnyPayload`: shared memory, CUDA
IPC, ...; the annotation is what the decoder validates against).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from mstar.transport.placed_channels import AnyPayload

Tensors = dict[str, AnyPayload]  # edge or port name -> tensor payload


class StartWalk(msgspec.Struct, tag=True, array_like=True):
    """Conductor -> driver worker: run one walk of one request."""

    rid: str
    walk: str
    options: dict[str, Any]  # per-request model options
    inputs: Tensors  # walk inputs by edge name (request inputs and carries)
    routes: dict[str, int]  # node name -> rank that runs it
    stream_targets: dict[str, list[Any]]  # produced edge -> [consumer rank, stream name, first seq]
    # component -> rank that continues the request's sequence of it in the next walk: the sequence's K/V
    # stream there layer by layer as this walk computes them (PD disaggregation, worker/kv_moves.py)
    kv_targets: dict[str, int] = {}


class _ReadyNode(msgspec.Struct, array_like=True):
    """A ready node of one request, as a message carries it (the fields a worker makes a StepItem of)."""

    rid: str
    walk: str
    node: str
    iteration: int
    inputs: Tensors  # port -> tensor
    options: dict[str, Any]  # per-request model options


class RunNode(_ReadyNode, tag=True):
    """Driver -> worker: run one node of a walk whose driver lives elsewhere."""

    reply_to: int
    loop: int = 0  # > 0: the node is an engine loop of this many iterations at most (engines/base.py LoopSpec)
    kv_targets: dict[str, int] = {}  # the node's component -> as StartWalk.kv_targets


class NodeDone(msgspec.Struct, tag=True, array_like=True):
    """Worker -> driver: what a remote node produced."""

    rid: str
    walk: str
    node: str
    iteration: int
    outputs: Tensors
    stop: bool = False
    error: str | None = None
    finish_reason: str | None = None
    more: bool = False  # an engine loop's iteration that does not end it (the node stays running)


class StreamItem(msgspec.Struct, tag=True, array_like=True):
    """Producer driver -> consumer worker: one item of a stream, in order by seq."""

    rid: str
    stream: str
    seq: int
    value: AnyPayload


class StreamEnd(msgspec.Struct, tag=True, array_like=True):
    """Conductor -> consumer worker: the stream holds exactly `total` items."""

    rid: str
    stream: str
    total: int


class Release(msgspec.Struct, tag=True, array_like=True):
    """Conductor -> worker: forget the request (finished, failed or cancelled)."""

    rid: str


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Conductor -> worker: stop the loop and exit."""


class ClientOutput(msgspec.Struct, tag=True, array_like=True):
    """Driver -> API process: one emitted value for the caller."""

    rid: str
    name: str
    value: AnyPayload


class ClientOutputs(msgspec.Struct, tag=True, array_like=True):
    """Driver -> API process: the values one engine step of a worker emitted, in emission order (one
    message, not one per value; sent before any later message of that worker to the conductor)."""

    outputs: list[ClientOutput]


class WalkDone(msgspec.Struct, tag=True, array_like=True):
    """Driver -> conductor: a walk finished (or failed)."""

    rid: str
    walk: str
    carries: Tensors
    stream_counts: dict[str, int]  # stream name -> items this walk produced
    stopped: bool = False  # a node outside any loop asked to stop: the lane ends
    finish_reason: str | None = None
    error: str | None = None


class KVOffer(msgspec.Struct, tag=True, array_like=True):
    """Worker about to compute a request's sequence of `component` -> the worker that continues it: take
    pages for it; `page_hashes` are those of its full pages you may hold already (they need not travel).
    The sequence computes nothing until the KVAccept."""

    rid: str
    component: str
    kv_slot: str
    tokens: list[int]
    page_hashes: list[bytes]  # 16-byte little-endian page hashes (engines/kv_cache/prefix_cache.py)
    reply_to: int


class KVAccept(msgspec.Struct, tag=True, array_like=True):
    """Answer to KVOffer, once the receiver took pages (offers queue for them, first come first): the K/V of
    the sequence's tokens from `skip` on will come (the receiver holds those before it and has pages for the
    rest); `skip` < 0: declined (its whole pool cannot hold it, or the offer waited past the receiver's
    `kv_offer_timeout_s`), nothing is sent and the receiver recomputes (a sequence with media rows or
    explicit positions fails instead, with `declined` in its error)."""

    rid: str
    component: str
    kv_slot: str
    skip: int
    declined: str = ""  # why, when skip < 0 (`KVWithdrawn`)


class KVLayer(msgspec.Struct, tag=True, array_like=True):
    """Sender -> receiver of an accepted KVOffer: the final K and V ([tokens, kv_heads, head_dim]) of
    tokens [start, start + tokens) of one layer, sent as soon as the sender's forward wrote them."""

    rid: str
    component: str
    kv_slot: str
    layer: int
    start: int
    k: AnyPayload
    v: AnyPayload


class KVPositionsWire(msgspec.Struct, array_like=True):
    """engines.kv_handoff.KVPositions on the wire."""

    start: int
    offset: float
    multi_row: bool
    fractional: bool
    num_shareable: int


class KVEnd(msgspec.Struct, tag=True, array_like=True):
    """Sender -> receiver, after the last KVLayer of the sequence: it is computed
    (engines.kv_handoff.KVStreamEnd) and the sender forgot it."""

    rid: str
    component: str
    kv_slot: str
    tokens: list[int]
    page_hashes: list[bytes]  # as KVOffer's, of the full pages whose K/V depend on their tokens alone
    positions: KVPositionsWire | None = None


class ReplicaItem(_ReadyNode):
    """One item of a replica step: a ready node of one request, as the lead rank's engine saw it."""

    kv_slot: str = "main"
    loop: int = 0  # > 0: an engine loop of this many iterations at most


class ReplicaStep(msgspec.Struct, tag=True, array_like=True):
    """Lead rank -> the other ranks of a multi-rank replica: run this batch with me, now, in this order.

    The followers run the same component call on the same items (its collectives pair with the
    lead's) and drop the outputs; only the lead routes results.
    """

    component: str
    items: list[ReplicaItem]


class ReplicaEngineStep(msgspec.Struct, tag=True, array_like=True):
    """Lead rank -> the other ranks of a tensor-parallel replica of an autoregressive component: take
    these releases and items, in this order, then step the engine once, now.

    The followers' engines see exactly what the lead's saw since its last step, so their batch
    schedulers pick the same chunks and their forwards' collectives pair with the lead's; only the lead
    routes results.
    """

    component: str
    releases: list[str]  # request ids released since the last step
    items: list[ReplicaItem]  # items submitted since the last step


class WorkerReady(msgspec.Struct, tag=True, array_like=True):
    """Worker -> conductor: components built and warmed up."""

    rank: int
    context_lens: dict[str, int] = {}  # component -> its autoregressive engine's max_model_len on this worker


class WorkerFailed(msgspec.Struct, tag=True, array_like=True):
    """Worker -> conductor: the worker cannot go on (e.g. a component failed to build)."""

    rank: int
    error: str


# Histogram bounds of WorkerStats (upper bounds; one more bucket, +Inf, comes last).
STEP_SECONDS_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ComponentStats(msgspec.Struct, array_like=True):
    """Load of one component's engine on one worker, cumulative since the worker started."""

    component: str
    gauges: dict[str, float]  # the engine's stats() (queue depth, KV pages, ...; mstar.engines.base.Engine.stats)
    steps: int  # steps that ran at least one item
    step_seconds_sum: float
    step_seconds_buckets: list[int]  # steps per bucket of STEP_SECONDS_BOUNDS, +Inf last (not cumulative)
    batch_items_sum: int
    batch_size_buckets: list[int]  # steps per bucket of BATCH_SIZE_BOUNDS, +Inf last (not cumulative)


class WorkerStats(msgspec.Struct, tag=True, array_like=True):
    """Worker -> conductor, about twice a second and only when something changed: engine load."""

    rank: int
    components: list[ComponentStats]


# the messages about one request (`rid`), and those of them about one of its walks (`walk`)
REQUEST_MESSAGES = (StartWalk, RunNode, NodeDone, StreamItem, StreamEnd, Release, ClientOutput, WalkDone, KVOffer,
                    KVAccept, KVLayer, KVEnd)
WALK_MESSAGES = (StartWalk, RunNode, NodeDone, WalkDone)

Message = Union[
    StartWalk, RunNode, NodeDone, StreamItem, StreamEnd, Release, Shutdown, ClientOutput, ClientOutputs, WalkDone,
    ReplicaStep, ReplicaEngineStep, WorkerReady, WorkerFailed, WorkerStats, KVOffer, KVAccept, KVLayer, KVEnd,
]
