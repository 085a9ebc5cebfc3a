"""Multi-rank replicas in lockstep: the lead rank forwards each batch to the other ranks, which run it too.

The conductor routes a replica's nodes to its lead rank (the first). There the component's module is
wrapped in `LeadModule`: before each batched call it sends the batch (`wire.ReplicaStep`) to the
followers, then runs the call; collectives inside the call (Ulysses all-to-alls) pair with the
followers' identical call. Followers run `run_component_step` on the items from the message, in the
order received, and drop the outputs. A failure on one rank only leaves the other waiting in a
collective until the group's timeout, which then fails the step.

An autoregressive engine keeps state (sequences, KV pages, its batch scheduler), so a tensor-parallel
replica of one is kept in lockstep at the engine's seam instead: on the lead, `LeadEngine` notes every
release and submitted item and, before each step, sends them (`wire.ReplicaEngineStep`); a follower's
engine takes the same releases and items in the same order and steps once (`FollowerEngine.follow`), so
its batch scheduler picks the same chunks and its sampling (seeded per request: `AutoregressiveEngine.
seed_per_request`) the same tokens and stops; an engine loop's later iterations need no message, each
rank appending the token it sampled, which is the lead's. A follower's engine (`FollowerEngine`) is stepped only
so, never by its worker's own loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from mstar.engines.base import CapturePlan, Engine, LoopSpec, StatelessComponent, StepGraphs, StepItem
from mstar.transport import wire

logger = logging.getLogger(__name__)


def run_component_step(module: StatelessComponent, items: Sequence[StepItem]) -> list[dict]:
    """The batched call a stateless engine makes for `items`."""
    return module.run_items(list(items))


def replica_items(items: Sequence[StepItem], pack: Callable[[Any, int], Any], to: int) -> list[wire.ReplicaItem]:
    """`items` as a replica message to rank `to` carries them, their tensors packed (`follower_items` undoes it)."""
    return [wire.ReplicaItem(i.request_id, i.walk, i.node, i.iteration, {k: pack(v, to) for k, v in i.inputs.items()},
                             i.options, i.kv_slot, i.loop.max_iterations if i.loop else 0) for i in items]


class LeadModule:
    """A component module on a replica's lead rank: same calls, but every batch goes to the followers first.

    `send(rank, message)` delivers a wire message; `pack(tensor, rank)` turns a tensor into its payload for `rank`.
    """

    def __init__(self, module: StatelessComponent, component: str, followers: Sequence[int],
                 send: Callable[[int, Any], None], pack: Callable[[Any, int], Any]) -> None:
        self.module, self.component = module, component
        self.followers = tuple(followers)
        self._send, self._pack = send, pack
        self.host_inputs, self.host_outputs = module.host_inputs, module.host_outputs
        self.side_stream = module.side_stream

    def batch_key(self, item: StepItem) -> Hashable:
        return self.module.batch_key(item)

    def run_items(self, items: list[StepItem]) -> list[dict]:
        for rank in self.followers:  # packed per follower: a payload is consumed by one reader
            self._send(rank, wire.ReplicaStep(self.component, replica_items(items, self._pack, rank)))
        return run_component_step(self.module, items)

    def release(self, request_id: str) -> None:
        self.module.release(request_id)

    @property
    def graphs(self) -> StepGraphs:  # captured on the wrapped module, which replays them in its run_items
        return self.module.graphs

    def capture_plans(self) -> Sequence[CapturePlan]:
        return self.module.capture_plans()


class LeadEngine:
    """An autoregressive engine on a tensor-parallel replica's lead rank: the same engine, but each step
    first sends the followers what the engine was given since the last one (module docstring)."""

    def __init__(self, engine: Engine, component: str, followers: Sequence[int], send: Callable[[int, Any], None],
                 pack: Callable[[Any, int], Any]) -> None:
        self.engine, self.component = engine, component
        self.host_inputs = engine.host_inputs
        self.followers = tuple(followers)
        self._send, self._pack = send, pack
        self._items: list[StepItem] = []
        self._releases: list[str] = []

    def submit(self, item: StepItem) -> None:
        self._items.append(item)
        self.engine.submit(item)

    def release(self, request_id: str) -> None:
        # the engine drops the request's pending items with it: so do the followers' (releases go first
        # in the message, then the items submitted since, which are all from after this release)
        self._items = [i for i in self._items if i.request_id != request_id]
        self._releases.append(request_id)
        self.engine.release(request_id)

    def step(self) -> list:
        items, releases, self._items, self._releases = self._items, self._releases, [], []
        for rank in self.followers:  # packed per follower: a payload is consumed by one reader
            self._send(rank, wire.ReplicaEngineStep(self.component, releases, replica_items(items, self._pack, rank)))
        return self.engine.step()

    def has_work(self) -> bool:
        return self.engine.has_work()

    @property
    def last_step_items(self) -> int:
        return self.engine.last_step_items

    def stats(self) -> dict[str, float]:
        return self.engine.stats()


class FollowerEngine:
    """An autoregressive engine on a tensor-parallel replica's follower rank: stepped only by the lead's
    messages (`follow`), never by its worker's loop (no work of its own) and never released but as the
    lead says (a worker-level release could land between two of the lead's steps)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.host_inputs = engine.host_inputs
        self.last_step_items = 0  # its steps are the lead's, counted there

    def follow(self, msg: wire.ReplicaEngineStep, items: list[StepItem]) -> None:
        """The lead's releases, its items (`items`, unpacked) and one step; the results are the lead's to
        route and are dropped here."""
        for rid in msg.releases:
            self.engine.release(rid)
        for item in items:
            self.engine.submit(item)
        self.engine.step()

    def submit(self, item: StepItem) -> None:
        raise RuntimeError("a follower rank's engine takes items from its lead only")

    def step(self) -> list:
        return []

    def has_work(self) -> bool:
        return False

    def release(self, request_id: str) -> None:
        pass  # the lead's ReplicaEngineStep carries it, in order

    def stats(self) -> dict[str, float]:
        return self.engine.stats()


def follower_items(msg: wire.ReplicaStep | wire.ReplicaEngineStep, unpack: Callable[[Any], Any], to_device: Callable[[Any], Any]
                   ) -> list[StepItem]:
    """The StepItems of a ReplicaStep, inputs on this worker's device."""
    return [StepItem(i.rid, i.walk, i.node, {k: to_device(unpack(v)) for k, v in i.inputs.items()}, i.options,
                     i.iteration, i.kv_slot, LoopSpec(i.loop) if i.loop else None) for i in msg.items]
