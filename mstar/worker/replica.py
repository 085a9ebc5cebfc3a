"""Multi-rank replicas in lockstep: the lead rank forwards each batch to the other ranks, which run it too.

The conductor routes a replica's nodes to its lead rank (the first). There the component's module is
wrapped in `LeadModule`: before each batched call it sends the batch (`wire.ReplicaStep`) to the
followers, then runs the call; collectives inside the call (Ulysses all-to-alls) pair with the
followers' identical call. Followers run `run_component_step` on the items from the message, in the
order received, and drop the outputs. A failure on one rank only leaves the other waiting in a
collective until the group's timeout, which then fails the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from mstar.engines.base import StepItem
from mstar.transport import wire

logger = logging.getLogger(__name__)


def run_component_step(module: Any, items: Sequence[StepItem]) -> list[dict]:
    """The batched call a stateless engine makes for `items` (run_items when the module has it)."""
    if hasattr(module, "run_items"):
        return module.run_items(list(items))
    head = items[0]
    return module.run_batch(head.walk, head.node, [i.inputs for i in items], [i.options for i in items])


class LeadModule:
    """A component module on a replica's lead rank: same calls, but every batch goes to the followers first.

    `send(rank, message)` delivers a wire message; `pack` turns a tensor into its payload.
    """

    def __init__(self, module: Any, component: str, followers: Sequence[int],
                 send: Callable[[int, Any], None], pack: Callable[[Any], Any]) -> None:
        self.module, self.component = module, component
        self.followers = tuple(followers)
        self._send, self._pack = send, pack

    def batch_key(self, item: StepItem) -> Hashable:
        key = getattr(self.module, "batch_key", None)
        return key(item) if key is not None else (item.walk, item.node)

    def run_items(self, items: list[StepItem]) -> list[dict]:
        for rank in self.followers:  # packed per follower: a payload is consumed by one reader
            msg_items = [wire.ReplicaItem(i.request_id, i.walk, i.node, i.iteration,
                                          {k: self._pack(v) for k, v in i.inputs.items()}, i.options)
                         for i in items]
            self._send(rank, wire.ReplicaStep(self.component, msg_items))
        return run_component_step(self.module, items)

    def release(self, request_id: str) -> None:
        release = getattr(self.module, "release", None)
        if release is not None:
            release(request_id)

    def __getattr__(self, name: str) -> Any:  # anything else (e.g. the transformer) is the module's
        return getattr(self.__dict__["module"], name)


def follower_items(msg: wire.ReplicaStep, unpack: Callable[[Any], Any], to_device: Callable[[Any], Any]
                   ) -> list[StepItem]:
    """The StepItems of a ReplicaStep, inputs on this worker's device."""
    return [StepItem(i.rid, i.walk, i.node, {k: to_device(unpack(v)) for k, v in i.inputs.items()}, i.options,
                     i.iteration) for i in msg.items]
