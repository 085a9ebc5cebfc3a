"""Declarative graph specs: what a model's walks look like, independent of any runtime or placement.

Edges are named tensors. A node reads edges through its input ports and writes edges through its
output ports; inside a walk, an input is fed by the nearest earlier producer of that edge name (or by
the walk's inputs), and inside a Loop by the previous iteration's value when the producer comes
later in the body (a loop-back edge). Specs are frozen and hold no tensors or request state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from mstar.graph.chunking import ChunkPolicy

TO_CLIENT = "client"  # Emit destination: stream the edge to the caller as a named output
CARRY = "carry"  # Emit destination: keep the edge's last value for later walks of the request
# An engine loop (`ModelGraph.engine_loop`) feeds the autoregressive engine's sampled token back as
# its next input: these are the two ports of that contract.
SAMPLED_PORT, FED_PORT = "token", "input_ids"


def _ports(spec: Mapping[str, str] | tuple[str, ...] | list[str] | str) -> tuple[tuple[str, str], ...]:
    """Normalise port specs: ("a", "b") means ports a and b fed by edges of the same name."""
    if isinstance(spec, str):
        spec = (spec,)
    if isinstance(spec, Mapping):
        return tuple(spec.items())
    return tuple((name, name) for name in spec)


@dataclass(frozen=True)
class Node:
    """A component's appearance in a walk: input ports <- edges, output ports -> edges."""

    component: str
    inputs: tuple[tuple[str, str], ...] = ()  # (port, edge) pairs
    outputs: tuple[tuple[str, str], ...] = ()  # (port, edge) pairs
    name: str = ""  # unique within the walk; defaults to the component name
    kv_slot: str = "main"  # which KV sequence of the request an autoregressive component uses

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", _ports(self.inputs))
        object.__setattr__(self, "outputs", _ports(self.outputs))
        if not self.name:
            object.__setattr__(self, "name", self.component)

    @property
    def input_edges(self) -> tuple[str, ...]:
        return tuple(edge for _, edge in self.inputs)

    @property
    def output_edges(self) -> tuple[str, ...]:
        return tuple(edge for _, edge in self.outputs)


@dataclass(frozen=True)
class Sequential:
    """Members run one after another."""

    members: tuple[Section, ...]

    def __init__(self, *members: Section) -> None:
        object.__setattr__(self, "members", tuple(members))


@dataclass(frozen=True)
class Parallel:
    """Members run concurrently (e.g. the branches of classifier-free guidance)."""

    members: tuple[Section, ...]

    def __init__(self, *members: Section) -> None:
        object.__setattr__(self, "members", tuple(members))


MaxIterations = Union[int, str, Callable[[Mapping], int]]


@dataclass(frozen=True)
class Loop:
    """Repeat `body` up to `max_iterations` times, or until a node of the body asks to stop.

    `max_iterations` is a number, the name of a request option, or a function of the request
    options, so a request's budget (e.g. max_tokens) is never silently capped by the graph.
    Edges named in `accumulate` are seen after the loop as the concatenation (dim 0) of every
    iteration's value; other edges produced in the body are seen after it with their last value.
    """

    body: Section
    max_iterations: MaxIterations
    name: str = "loop"
    accumulate: tuple[str, ...] = ()


Section = Union[Node, Sequential, Parallel, Loop]


@dataclass(frozen=True)
class Emit:
    """Send an edge out of a walk: to the client (as output `name`) or to the request's carries."""

    edge: str
    to: str = TO_CLIENT
    name: str = ""  # client output name or carry name; defaults to the edge name

    def __post_init__(self) -> None:
        if self.to not in (TO_CLIENT, CARRY):
            raise ValueError(f"Emit of {self.edge!r}: destination {self.to!r} must be {TO_CLIENT!r} or {CARRY!r}")
        if not self.name:
            object.__setattr__(self, "name", self.edge)


@dataclass(frozen=True)
class Walk:
    """A named graph section a request traverses, with its inputs (request inputs or carries)."""

    name: str
    lane: str
    body: Section
    inputs: tuple[str, ...] = ()
    emits: tuple[Emit, ...] = ()
    optional_inputs: tuple[str, ...] = ()  # inputs a request may leave out (the node sees no port)


@dataclass(frozen=True)
class StreamEdge:
    """An edge of one lane consumed in chunks by a walk of another lane.

    Every value of `edge` produced by any walk of `source_lane` is one item of the stream; a chunk
    is its items concatenated along `dim`. The `target_walk` sees the chunks as its input
    `target_input`. A node reading that input outside any Loop runs once per chunk until the stream
    ends; inside a Loop it takes one chunk per iteration (waiting for it), and once the stream has
    ended it runs without that input, so the loop can go on past the stream (a talker speaking
    after the text ended). Next to the chunk, such a node gets the ports `<input>_new` (how many of
    the chunk's items no earlier chunk held), `<input>_start` (the index of the chunk's first item
    in the stream) and `<input>_final` (no chunk follows).

    `accept(item, accepted)` (optional, the stream filter) drops items in stream order before
    chunking: `accepted` is how many items it let through so far, so it may depend on an item's
    position (Orpheus drops tokens that are no audio code at their place in a frame).
    """

    edge: str
    source_lane: str
    target_walk: str
    target_input: str
    policy: ChunkPolicy
    accept: Callable[[Any, int], bool] | None = None  # the stream filter
    dim: int = 0  # items are joined along this dim (e.g. 1 for [layers, tokens, hidden] states)


@dataclass(frozen=True)
class Lane:
    """Walks of a request that progress on their own. `transitions` maps a finished walk to the
    next one (None ends the lane); a callable gets (finished walk, request options) instead."""

    name: str
    first: str | None | Callable[[Mapping], str | None]
    transitions: Mapping[str, str | None] | Callable[[str, Mapping], str | None] = field(default_factory=dict)

    def first_walk(self, options: Mapping) -> str | None:
        return self.first(options) if callable(self.first) else self.first

    def next_walk(self, finished: str, options: Mapping) -> str | None:
        if callable(self.transitions):
            return self.transitions(finished, options)
        return self.transitions.get(finished)


@dataclass(frozen=True)
class ComponentSpec:
    """A component of a model: its engine kind and a one-line description."""

    engine: str  # "stateless" | "autoregressive"
    description: str = ""
    # When set, the component's steps see the request options with "<namespace>.<key>" as "<key>",
    # overriding a plain "<key>", and without other namespaced keys: per-component sampling options.
    option_namespace: str = ""
    # The module runs sequence-parallel (Ulysses) when given a replica's group, so a placement may use
    # sp_size > 1 for it; only stateless components can set it.
    sequence_parallel: bool = False
    # The model builds it as one rank's share (heads and experts; `layers.parallel.tensor_parallel` says
    # which) and its engine runs in lockstep with the replica's other ranks, so a placement may use
    # tp_size > 1 for it; only autoregressive components can set it.
    tensor_parallel: bool = False

    def __post_init__(self) -> None:
        if self.engine not in ("stateless", "autoregressive"):
            raise ValueError(f"component engine {self.engine!r} must be 'stateless' or 'autoregressive'")
        if self.sequence_parallel and self.engine != "stateless":
            raise ValueError(f"sequence_parallel=True needs a stateless component, not {self.engine!r}")
        if self.tensor_parallel and self.engine != "autoregressive":
            raise ValueError(f"tensor_parallel=True needs an autoregressive component, not {self.engine!r}")


@dataclass(frozen=True)
class ModelGraph:
    """Everything a model declares: components, walks, lanes and the streams between lanes."""

    components: Mapping[str, ComponentSpec]
    walks: tuple[Walk, ...]
    lanes: tuple[Lane, ...]
    streams: tuple[StreamEdge, ...] = ()

    def walk(self, name: str) -> Walk:
        for walk in self.walks:
            if walk.name == name:
                return walk
        raise KeyError(f"no walk {name!r}; walks are {[w.name for w in self.walks]}")

    def engine_loop(self, walk: Walk, loop: Loop) -> Node | None:
        """The node of `loop` when the loop is an *engine loop*, else None.

        An engine loop's body is one node of an autoregressive component that feeds its sampled token
        (port `token`) back into its own `input_ids` and has no other loop-back edge and no stream
        input. Its engine runs every iteration itself, appending each sample as the next input and
        yielding one result per iteration; the walk interpreter resumes only when the loop ends. Every
        other loop runs iteration by iteration through the interpreter."""
        node = loop.body
        if not isinstance(node, Node) or self.components[node.component].engine != "autoregressive":
            return None
        inputs, outputs = dict(node.inputs), dict(node.outputs)
        fed = outputs.get(SAMPLED_PORT)
        if fed is None or inputs.get(FED_PORT) != fed:
            return None
        if any(edge in node.input_edges for port, edge in node.outputs if port != SAMPLED_PORT):
            return None
        streamed = {s.target_input for s in self.streams if s.target_walk == walk.name}
        return None if streamed & set(node.input_edges) else node

    def step_order(self) -> list[str]:
        """Every component, in the order a worker steps their engines: as they first appear in the walks
        (in declaration order, each walk's nodes in program order), then any in no walk, by name.

        Program order is data-flow order, so a loop whose body spans several components on one worker
        (Qwen3-Omni's talker_input -> talker -> code_predictor) makes one iteration per pass over the
        engines; stepped against its flow (by name: code_predictor, talker, talker_input) it would make
        one every two passes, each pass also paying every other busy engine's step."""
        order: dict[str, None] = {}
        for walk in self.walks:
            for node in iter_nodes(walk.body):
                order.setdefault(node.component, None)
        return [*order, *sorted(set(self.components) - set(order))]


def iter_loops(section: Section):
    """Yield every Loop of a section in program order (outer loops first)."""
    if isinstance(section, Loop):
        yield section
        yield from iter_loops(section.body)
    elif isinstance(section, (Sequential, Parallel)):
        for member in section.members:
            yield from iter_loops(member)


def iter_nodes(section: Section):
    """Yield every Node of a section in program order."""
    if isinstance(section, Node):
        yield section
    elif isinstance(section, Loop):
        yield from iter_nodes(section.body)
    else:
        for member in section.members:
            yield from iter_nodes(member)
