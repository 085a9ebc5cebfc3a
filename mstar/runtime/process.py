"""Entry point of a worker process: build, report ready, serve, and die with the parent (`serve_worker`,
the build-and-serve part, also runs in Ray actors: `ray_workers.py`)."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from mstar import envs

logger = logging.getLogger(__name__)


def stacks_on_sigusr1(children: Callable[[], list[int]] | None = None) -> None:
    """`kill -USR1 <pid>` writes every thread's Python stack to stderr (where a stuck server is stuck);
    the process goes on. With `children` (a server's worker processes) it passes the signal on to them."""
    if not hasattr(signal, "SIGUSR1"):
        return
    if children is None:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        return

    def dump(_signum: int, _frame: Any) -> None:
        faulthandler.dump_traceback(all_threads=True)
        for pid in children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)

    faulthandler.unregister(signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, dump)


def die_with_parent() -> None:
    """Ask the kernel to kill us when the parent dies; a watchdog thread backs it up."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the OS keeps one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_thread_shares(devices: Sequence[str], cores: int, omp_num_threads: str | None) -> dict[int, int]:
    """Rank -> torch intra-op threads of each rank among `devices` (each rank's device type, every rank on
    one host of `cores` cores). A CPU rank gets an equal share of the cores among the CPU ranks, at least
    one. A GPU rank gets one once built (`serve_worker`): serving, its host work is glue around device
    calls (input copies, small tensors), and each idle thread of an OpenMP pool spins for milliseconds
    after every parallel op, on cores that the server process and the other workers are waiting for. None
    where the user set `omp_num_threads` (OMP_NUM_THREADS, which the workers inherit): that choice stands."""
    if omp_num_threads:
        return {}
    cpu_ranks = [rank for rank, device in enumerate(devices) if device == "cpu"]
    shares = dict.fromkeys((rank for rank, device in enumerate(devices) if device != "cpu"), 1)
    if cpu_ranks:
        shares.update(dict.fromkeys(cpu_ranks, max(1, cores // len(cpu_ranks))))
    return shares


def worker_process_main(rank: int, config_json: bytes, directory_json: bytes, session: str, build_args: dict,
                        rendezvous: list | None = None, cpu_threads: int | None = None) -> None:
    """Run one worker until Shutdown (spawned by runtime.launcher); with `rendezvous` ([host, port,
    world size]) it first joins the torch.distributed groups of its multi-rank replicas. `cpu_threads`
    (`cpu_thread_shares`: a CPU worker's share of the host, one for a GPU worker) sets its torch intra-op
    threads (`serve_worker` says when)."""
    die_with_parent()
    stacks_on_sigusr1()
    os.environ[envs.SESSION.name] = session
    logging.basicConfig(level=build_args.pop("log_level", "WARNING"))
    from mstar.runtime.build import worker_device
    from mstar.runtime.codecs import worker_codec

    def codec_for(config: Any, plan: Any) -> Any:
        return worker_codec(session, rank, [worker_device(config, r) for r in range(plan.num_workers)])

    serve_worker(rank, config_json, directory_json, build_args, codec_for, rendezvous, cpu_threads)


def serve_worker(rank: int, config_json: bytes, directory_json: bytes, build_args: dict,
                 codec_for: Callable[[Any, Any], Any], rendezvous: list | None = None,
                 threads: int | None = None) -> None:
    """Build worker `rank` (its codec from `codec_for(config, plan)`), report ready or failed to the
    conductor, and serve until Shutdown; shared by worker processes and Ray actors. `threads` sets the
    torch intra-op threads: a CPU worker's before it builds, a GPU worker's once built, since building
    may want every thread on the host (a blocking copy onto the GPU that changes the dtype, as loading a
    float32 checkpoint in bfloat16 does, converts on the CPU)."""
    from mstar.config import config_from_dict
    from mstar.graph.placement import plan_placement
    from mstar.runtime.build import build_engines, build_model, context_lens, use_device, worker_device
    from mstar.transport import wire
    from mstar.transport.messages import Codec
    from mstar.transport.zmq_channels import Directory, ZmqNetwork
    from mstar.worker.worker import CONDUCTOR, Worker, worker_peer

    network = ZmqNetwork(msgspec.json.decode(directory_json, type=Directory), Codec(wire.Message))
    inbox, outbox = network.inbox(worker_peer(rank)), network.outbox()
    groups = None
    try:
        config = config_from_dict(msgspec.json.decode(config_json))
        model = build_model(config, **build_args)
        graph = model.graph()
        plan = plan_placement(graph, config.node_groups, config.source)
        device = worker_device(config, rank)
        if threads is not None and device.type == "cpu":
            _set_threads(rank, threads)
        use_device(device)
        codec = codec_for(config, plan)
        shards = {}
        if rendezvous is not None:  # groups first: a tensor-parallel component warms up with its collectives
            from mstar.distributed.groups import Rendezvous
            from mstar.runtime.replicas import start_replica_groups, tensor_parallel_shards, wrap_replicas

            groups = start_replica_groups(plan, rank, device, Rendezvous(*rendezvous))
            shards = tensor_parallel_shards(plan, graph, rank, groups)
        engines = build_engines(model, config, plan.components_on(rank), device, shards)
        lens = context_lens(engines)
        if groups is not None:
            wrap_replicas(plan, graph, rank, engines, groups, lambda r, msg: outbox.send(worker_peer(r), msg),
                          codec.pack)
        worker = Worker(rank, graph, engines, inbox, outbox, codec, device)
        if threads is not None and device.type != "cpu":
            _set_threads(rank, threads)
    except Exception:
        outbox.send(CONDUCTOR, wire.WorkerFailed(rank, traceback.format_exc()))
        time.sleep(0.2)
        network.close()
        return
    # Everything built so far (modules, weights' wrappers, captured graphs, imported code) lives as
    # long as the process: frozen, it is left out of the collector's full passes, which would
    # otherwise walk it again and again while requests run.
    gc.collect()
    gc.freeze()
    outbox.send(CONDUCTOR, wire.WorkerReady(rank, lens))
    worker.run()
    if groups is not None:
        groups.close()
    network.close()


def _set_threads(rank: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    logger.info("worker %d: %d intra-op threads", rank, torch.get_num_threads())
