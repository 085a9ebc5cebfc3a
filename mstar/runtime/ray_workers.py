"""Workers as Ray actors on a Ray cluster (`mstar serve --ray-address`).

The conductor stays in the calling process (the head). `RayCluster` reserves one placement-group bundle
per worker rank, built from the config's `ray` section, and starts a `WorkerActor` (a process of its
own) in each. Starting takes two rounds through Ray: each actor first reports where it runs and the
tcp:// address its inbox will listen at (`prepare`); once every address is known, each builds and serves
its worker with the whole directory (`serve`). Control messages then go over ZMQ on TCP, never through
Ray, and tensors by the channel each edge's hosts call for (a Ray node counts as one host). An actor that
dies ends its `serve` call with an error, which the watch thread reports like a dead worker process;
a restarted rank's actor goes into the same bundle and listens at the same address.

Ray is an optional dependency (`pip install 'mstar[ray]'`), imported only inside these functions.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from mstar import envs
from mstar.config import MStarConfig
from mstar.transport.placed_channels import Endpoint
from mstar.transport.zmq_channels import Directory
from mstar.worker.worker import CONDUCTOR, worker_peer

logger = logging.getLogger(__name__)
PLACEMENT_TIMEOUT_S = 60.0  # how long the cluster may take to find room for every bundle


class WorkerSite(msgspec.Struct, frozen=True):
    """Where one worker actor runs, as it reports it."""

    node_id: str  # the Ray node: tensors between two nodes leave the host
    ip: str  # the node's address, which peers reach its sockets at
    inbox: str  # tcp:// endpoint its inbox binds
    device: str  # "cuda" or "cpu"


def import_ray() -> Any:
    """The ray module, or a ModuleNotFoundError naming the extra that brings it."""
    try:
        import ray
    except ModuleNotFoundError:
        raise ModuleNotFoundError("workers on a Ray cluster need Ray: pip install 'mstar[ray]'", name="ray") from None
    return ray


def free_port(ip: str) -> int:
    """A TCP port free on `ip` now (its user binds it moments later)."""
    with socket.socket() as sock:
        sock.bind((ip, 0))
        return sock.getsockname()[1]


class WorkerActor:
    """One worker rank inside a Ray actor process (wrapped with `ray.remote` by `RayCluster`)."""

    def prepare(self, rank: int, session: str, config_json: bytes, port: int | None = None) -> WorkerSite:
        """Say where this rank runs and listens (at `port` when given: a restart keeps its address)."""
        import ray

        from mstar.config import config_from_dict
        from mstar.runtime.build import worker_device

        os.environ[envs.SESSION.name] = session
        self.session, self.ip = session, ray.util.get_node_ip_address()
        device = worker_device(config_from_dict(msgspec.json.decode(config_json)), rank).type
        inbox = f"tcp://{self.ip}:{port or free_port(self.ip)}"
        return WorkerSite(ray.get_runtime_context().get_node_id(), self.ip, inbox, device)

    def serve(self, rank: int, config_json: bytes, directory_json: bytes, endpoints_json: bytes,
              build_args: dict) -> None:
        """Build the worker and serve until Shutdown; `endpoints_json` says where every peer runs."""
        from mstar.runtime.codecs import placed_codec
        from mstar.runtime.process import serve_worker
        from mstar.transport.tcp_tensors import TcpTensorChannel

        logging.basicConfig(level=build_args.pop("log_level", "WARNING"))
        endpoints = msgspec.json.decode(endpoints_json, type=dict[str, Endpoint])
        tcp = TcpTensorChannel(self.ip)  # lives as long as the actor's process
        serve_worker(rank, config_json, directory_json, build_args,
                     lambda config, plan: placed_codec(self.session, worker_peer(rank), endpoints, tcp))


class RayCluster:
    """The Ray side of a runtime: one bundle and one `WorkerActor` per rank, and a watch on them."""

    def __init__(self, address: str, config: MStarConfig, session: str) -> None:
        ray = import_ray()
        from ray.util.placement_group import placement_group

        self.config, self.session = config, session
        self._owns_connection = not ray.is_initialized()
        if self._owns_connection:
            try:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
            except ConnectionError as exc:  # a start mistake: one line, as a config mistake is
                raise ValueError(f"no Ray cluster at {address!r}: {exc}") from None
        self.head = WorkerSite(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), "", "cpu")
        self._bundles = [self._bundle(rank) for rank in range(config.num_workers)]
        self.group = placement_group([b["bundle"] for b in self._bundles], strategy=config.ray.strategy)
        if not self.group.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
            ray.util.remove_placement_group(self.group)
            raise ValueError(f"{config.source}: the Ray cluster at {address} found no room for the workers' bundles "
                               f"{[b['bundle'] for b in self._bundles]} within {PLACEMENT_TIMEOUT_S:.0f} s; it has "
                               f"{ray.cluster_resources()} (see the config's ray.workers)")
        self.actors: dict[int, Any] = {}
        self.sites: dict[int, WorkerSite] = {}
        self._serving: dict[Any, int] = {}  # the ObjectRef of each actor's serve call -> its rank
        self._lock = threading.Lock()
        self._serve_args: tuple = ()

    def prepare(self, config_json: bytes) -> tuple[Directory, dict[str, Endpoint]]:
        """Start every rank's actor; the directory of every inbox (the conductor's on the head) and where
        every process runs."""
        ray = import_ray()
        self._config_json = config_json
        for rank in range(self.config.num_workers):
            self.actors[rank] = self._actor(rank)
        sites = ray.get([self.actors[r].prepare.remote(r, self.session, config_json) for r in sorted(self.actors)])
        self.sites = dict(enumerate(sites))
        conductor = f"tcp://{self.head.ip}:{free_port(self.head.ip)}"
        directory = Directory.tcp_addresses({CONDUCTOR: conductor} | {worker_peer(r): s.inbox for r, s in self.sites.items()})
        endpoints = {CONDUCTOR: Endpoint(self.head.node_id, "cpu")}
        endpoints |= {worker_peer(r): Endpoint(s.node_id, s.device) for r, s in self.sites.items()}
        self._serve_args = (config_json, msgspec.json.encode(directory), msgspec.json.encode(endpoints))
        for rank, site in self.sites.items():
            logger.info("worker %d: Ray node %s (%s), %s", rank, site.node_id[:12], site.ip, site.device)
        return directory, endpoints

    def serve(self, build_args: dict) -> None:
        """Have every actor build its worker and serve."""
        self._build_args = build_args
        for rank in self.actors:
            self._start_serving(rank)

    def restart(self, rank: int) -> None:
        """A new actor for `rank` in its bundle, listening at the dead one's address."""
        ray = import_ray()
        self.actors[rank] = self._actor(rank)
        port = int(self.sites[rank].inbox.rsplit(":", 1)[1])
        # a bundle whose node is gone waits for room that may never come: that ends the runtime
        site = ray.get(self.actors[rank].prepare.remote(rank, self.session, self._config_json, port),
                       timeout=PLACEMENT_TIMEOUT_S)
        if site.node_id != self.sites[rank].node_id:
            raise RuntimeError(f"worker {rank}'s bundle moved to another Ray node ({site.ip}); its peers cannot follow")
        self._start_serving(rank)

    def watch(self, on_death: Callable[[int, str], None], stopping: Callable[[], bool]) -> None:
        """Until `stopping()`: call `on_death(rank, reason)` for each actor whose serve call fails."""
        ray = import_ray()
        from ray.exceptions import RayError

        while not stopping():
            with self._lock:
                refs = list(self._serving)
            if not refs:
                threading.Event().wait(0.5)
                continue
            done, _ = ray.wait(refs, num_returns=1, timeout=0.5)
            for ref in done:
                with self._lock:
                    rank = self._serving.pop(ref)
                try:
                    ray.get(ref)
                except RayError as exc:
                    if not stopping():
                        on_death(rank, f"its Ray actor died ({_first_line(exc)})")
                    continue
                if not stopping():
                    on_death(rank, "its Ray actor stopped serving")

    def stop(self) -> None:
        """Kill the actors (after their workers had their Shutdown) and give the bundles back."""
        ray = import_ray()
        with self._lock:
            serving = list(self._serving)
        if serving:  # each worker leaves its loop on Shutdown; give them a moment to close their sockets
            ray.wait(serving, num_returns=len(serving), timeout=5)
        for actor in self.actors.values():
            ray.kill(actor)
        ray.util.remove_placement_group(self.group)
        if self._owns_connection:
            ray.shutdown()

    def _start_serving(self, rank: int) -> None:
        config_json, directory_json, endpoints_json = self._serve_args
        ref = self.actors[rank].serve.remote(rank, config_json, directory_json, endpoints_json, dict(self._build_args))
        with self._lock:
            self._serving[ref] = rank

    def _bundle(self, rank: int) -> dict[str, Any]:
        """Rank's bundle and the options its actor asks for, from the config's `ray.workers`."""
        ray = import_ray()
        entry = self.config.ray.bundle_of(rank)
        gpus = entry.num_gpus
        if gpus is None:
            gpus = 1.0 if self.config.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0 else 0.0
        resources = dict(entry.resources)
        if entry.node_ip is not None:  # Ray gives every node the resource node:<its IP>
            resources[f"node:{entry.node_ip}"] = 0.001
        bundle = {"CPU": entry.num_cpus, **({"GPU": gpus} if gpus else {}), **resources}
        return {"bundle": bundle, "num_cpus": entry.num_cpus, "num_gpus": gpus, "resources": resources}

    def _actor(self, rank: int) -> Any:
        ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = self._bundles[rank]
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)
        return ray.remote(WorkerActor).options(
            num_cpus=spec["num_cpus"], num_gpus=spec["num_gpus"],
            resources=spec["resources"], scheduling_strategy=strategy, max_restarts=0,
        ).remote()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
