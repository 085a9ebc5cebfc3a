"""Process groups of multi-rank replicas: one torch.distributed world per deployment, one group per replica.

Every worker of a deployment joins one torch.distributed world at a rendezvous address the launcher
chooses (`Rendezvous`); each replica of more than one rank (tp x sp) gets its own group, created by
its members only. The `ProcessGroups` object is the one registry a worker holds: it maps a replica's
ranks to its `ReplicaGroup`. Backend: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rendezvous:
    """Where the workers of one deployment meet: a TCP address and how many workers join."""

    host: str  # address of the rank-0 worker's store, e.g. "127.0.0.1"
    port: int  # a free TCP port chosen by the launcher
    world_size: int  # every worker of the deployment
    timeout_s: float = 300.0  # how long a worker waits for the others at init and in collectives

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"rendezvous port {self.port} is out of range; pass a free TCP port in 1..65535")
        if self.world_size < 1:
            raise ValueError(f"rendezvous world_size={self.world_size}; use the number of workers (>= 1)")

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"


@dataclass(frozen=True)
class ReplicaGroup:
    """This worker's view of one replica: its ranks (lead first), its place in them, the torch group."""

    ranks: tuple[int, ...]  # worker (world) ranks of the replica, lead rank first
    rank: int  # this worker's world rank
    group: Any  # torch.distributed.ProcessGroup over `ranks`

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> int:
        """This worker's rank inside the replica (0 = the lead)."""
        return self.ranks.index(self.rank)

    @property
    def is_lead(self) -> bool:
        return self.index == 0


def backend_for(device: torch.device) -> str:
    """The collective backend for tensors on `device`: nccl for CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


class ProcessGroups:
    """The registry of one worker's replica groups; `start` joins the world, `close` leaves it.

    `start(replicas)` must be called by every worker of the deployment (the world rendezvous waits
    for all of them); each group is then created by its own members, in sorted order of replicas.
    """

    def __init__(self, rendezvous: Rendezvous, rank: int, device: torch.device) -> None:
        if not 0 <= rank < rendezvous.world_size:
            raise ValueError(f"worker rank {rank} is outside the world of {rendezvous.world_size} workers")
        self.rendezvous, self.rank, self.device = rendezvous, rank, device
        self._groups: dict[tuple[int, ...], ReplicaGroup] = {}
        self._started = False

    def start(self, replicas: Iterable[tuple[int, ...]]) -> None:
        """Join the world, then create a group for each replica of this rank with more than one rank."""
        import torch.distributed as dist

        if self._started:
            raise RuntimeError("ProcessGroups.start was called twice; one registry starts once per worker")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process; one ProcessGroups "
                               "object must own it (close the other one first)")
        rv = self.rendezvous
        options: dict[str, Any] = {}
        if self.device.type == "cuda":
            options["device_id"] = self.device  # eager NCCL init, bound to this worker's GPU
        dist.init_process_group(backend_for(self.device), init_method=rv.init_method, rank=self.rank,
                                world_size=rv.world_size, timeout=timedelta(seconds=rv.timeout_s), **options)
        self._started = True
        for ranks in sorted({tuple(r) for r in replicas if self.rank in r and len(r) > 1}):
            group = dist.new_group(list(ranks), use_local_synchronization=True)
            self._groups[ranks] = ReplicaGroup(ranks, self.rank, group)
            logger.info("worker %d joined replica group %s", self.rank, ranks)

    def group(self, ranks: tuple[int, ...]) -> ReplicaGroup:
        """The group of the replica `ranks`; an error lists the replicas this worker belongs to."""
        key = tuple(ranks)
        if key not in self._groups:
            raise KeyError(f"worker {self.rank} has no group for replica {key}; it has {sorted(self._groups)}")
        return self._groups[key]

    def close(self) -> None:
        """Leave the world (destroys every group); safe to call twice."""
        import torch.distributed as dist

        if self._started and dist.is_initialized():
            dist.destroy_process_group()
        self._groups.clear()
        self._started = False
