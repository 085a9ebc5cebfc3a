"""Start a conductor and its workers, in one process (threads) or across processes.

Both modes run the same Worker and Conductor code; only the channels and the tensor codec differ. An
in-process worker builds its engines on its own thread (`_start_inproc_worker` says why).

The conductor's receive loop runs on a thread of its own (`mstar-conductor`). In `multiproc` mode a
watchdog reaps a worker process that exits, fails its requests and restarts it with backoff
(`supervisor.py`); a rank of a multi-rank replica, or one that died too often, makes the runtime give up
(`Runtime.fatal`); an in-process worker thread that ends with an error fails every request and makes it
give up. With `ray_address` each worker is a Ray actor on a cluster instead (`ray_workers.py`),
watched and restarted the same way. `Runtime.drain` stops being ready and ends open requests at a shutdown deadline.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from mstar import envs
from mstar.conductor.conductor import AdmissionError, Conductor
from mstar.conductor.request_state import Sink
from mstar.config import MStarConfig
from mstar.graph import validate_graph
from mstar.graph.placement import plan_placement
from mstar.runtime.build import build_engines, build_model, context_lens, use_device, worker_device
from mstar.runtime.codecs import LocalCodec, PayloadCodec
from mstar.runtime.memory_plan import check_memory
from mstar.runtime.replicas import check_run_mode, multi_rank_replicas
from mstar.runtime.supervisor import RestartPolicy, exit_reason
from mstar.transport import wire
from mstar.transport.channels import make_network
from mstar.transport.messages import Codec
from mstar.transport.tensors import cleanup_segments, new_session_id
from mstar.worker.worker import CONDUCTOR, Worker, worker_peer

if TYPE_CHECKING:
    from mstar.runtime.ray_workers import RayCluster

logger = logging.getLogger(__name__)
MODES = ("inproc", "multiproc")


class Runtime:
    """A running model: `submit` requests, `cancel` them, `shutdown` at the end."""

    def __init__(self, config: MStarConfig, mode: str = "inproc", tiny: bool = False, load_format: str = "auto",
                 model_path: str | None = None, ready_timeout_s: float = 600.0, ray_address: str | None = None) -> None:
        """`ray_address` (a Ray cluster's address, or "auto") runs each worker as a Ray actor placed by the
        config's `ray` section; `mode` is then "ray"."""
        if mode not in (*MODES, "auto"):
            raise ValueError(f"unknown run mode {mode!r}; use one of {(*MODES, 'auto')}")
        if ray_address is not None:
            mode = "ray"
        elif mode == "auto":  # one process per worker on CUDA machines: HTTP and workers never share a GIL
            mode = "multiproc" if torch.cuda.is_available() else "inproc"
        self.config, self.mode = config, mode
        self._build_args = {"tiny": tiny, "load_format": load_format, "model_path": model_path}
        self.model = build_model(config, **self._build_args)
        self.graph = self.model.graph()
        validate_graph(self.graph)
        self.plan = plan_placement(self.graph, config.node_groups, config.source)
        check_run_mode(self.plan, mode)
        if mode != "ray":  # Ray workers run on other machines' GPUs, which this process cannot size
            check_memory(config, tiny=tiny, model_path=model_path)  # before any weight is loaded
        self.processor = self.model.processor()
        self.session = new_session_id()
        self.cluster: RayCluster | None = None
        if mode == "ray":
            self._start_cluster(ray_address)
        else:
            self.codec = LocalCodec() if mode == "inproc" else PayloadCodec(self.session)
            self.network = make_network("inproc" if mode == "inproc" else "ipc", Codec(wire.Message))
        self._inbox = self.network.inbox(CONDUCTOR)
        self._outbox = self.network.outbox()
        self._send_lock = threading.Lock()
        self.conductor = Conductor(self.graph, self.plan, self._send, self.codec,
                                   config.max_concurrent_requests, config.max_queued_requests)
        self.workers: dict[int, Any] = {}  # rank -> Worker (inproc) or Process
        self._threads: list[threading.Thread] = []
        self._ready: set[int] = set()
        self._stopping = False
        self.draining = False  # shutting down: not ready, and open requests end at the drain deadline
        self.fatal: str | None = None  # why the runtime cannot go on (a worker died too often); then exit
        self._on_fatal: list[Any] = []
        self._restarts = RestartPolicy()
        self._down: set[int] = set()  # worker processes that died and wait for their restart
        self._last_message = time.monotonic()  # from any worker: the watchdog's sign of progress
        self._watchdog_s = envs.watchdog_s()
        self._start_workers()
        self._receiver = threading.Thread(target=self._receive_loop, daemon=True, name="mstar-conductor")
        self._receiver.start()
        self._wait_ready(ready_timeout_s)

    # -- public ------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return len(self._ready) == self.plan.num_workers and not self._stopping and not self.draining

    def worker_pids(self) -> list[int]:
        """Process ids of the worker processes (none in-process)."""
        return [w.pid for w in self.workers.values() if isinstance(getattr(w, "pid", None), int)]

    def drain(self, deadline_s: float) -> None:
        """Stop being ready now; end the requests still open after `deadline_s` with an error, so each
        client gets a clear last message before the server closes."""
        if self.draining:
            return
        self.draining = True
        timer = threading.Timer(deadline_s, self.end_open_requests)
        timer.daemon = True
        timer.start()

    def end_open_requests(self) -> None:
        """End every queued and running request now with a 503 saying the server is shutting down."""
        ended = self.conductor.fail_all("the server is shutting down; retry on another replica", 503)
        if ended:
            logger.warning("shutdown deadline: ended %d open requests", ended)

    def health_problem(self) -> str | None:
        """Why the server should not be trusted now, or None: it gave up (`fatal`), the conductor is
        wedged, or no worker has said anything for MSTAR_WATCHDOG_S while requests are in flight."""
        if self.fatal:
            return self.fatal
        try:
            busy_since = self.conductor.busy_since(lock_timeout_s=1.0)
        except TimeoutError as exc:
            return str(exc)
        if busy_since is None:
            return None
        quiet = time.monotonic() - max(self._last_message, busy_since)
        if quiet > self._watchdog_s:
            return f"no worker has reported for {quiet:.0f} s while requests are in flight (MSTAR_WATCHDOG_S)"
        return None

    def on_fatal(self, callback) -> None:
        """Call `callback()` (from a watchdog thread) once the runtime gives up; `fatal` says why."""
        self._on_fatal.append(callback)

    def submit(self, rid: str, inputs: dict[str, Any], options: dict[str, Any], sink: Sink) -> None:
        if self._stopping:  # its workers are gone: the request would wait forever
            raise AdmissionError("the runtime is shut down; start a new one to run requests")
        self.conductor.submit(rid, inputs, options, sink)

    def cancel(self, rid: str) -> bool:
        return self.conductor.cancel(rid)

    def shutdown(self) -> None:
        """Stop workers and threads; remove every shared-memory segment of this session."""
        if self._stopping:
            return
        self._stopping = True
        # requests still open would otherwise wait forever on workers that are gone
        self.conductor.fail_all("the runtime is shutting down", 503)
        for rank in self.workers:
            self._send(rank, wire.Shutdown())
        for worker in self.workers.values():
            if isinstance(worker, mp.process.BaseProcess):
                worker.join(timeout=5)
                if worker.is_alive():
                    worker.kill()
        for thread in self._threads:
            thread.join(timeout=5)
        if self.cluster is not None:
            self.cluster.stop()
            self._tcp.close()
        self._receiver.join(timeout=2)
        self.network.close()
        cleanup_segments(self.session)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- internals ---------------------------------------------------------------------------

    def _send(self, rank: int, msg: Any) -> None:
        with self._send_lock:
            try:
                self._outbox.send(worker_peer(rank), msg)
            except Exception:
                logger.exception("could not send %s to worker %d", type(msg).__name__, rank)

    def _start_cluster(self, address: str) -> None:
        """Reserve the Ray bundles, start the actors and learn their addresses; the conductor listens on
        the head and takes tensors from other nodes over TCP."""
        from mstar.runtime.codecs import placed_codec
        from mstar.runtime.ray_workers import RayCluster
        from mstar.transport.tcp_tensors import TcpTensorChannel
        from mstar.transport.zmq_channels import ZmqNetwork

        self.cluster = RayCluster(address, self.config, self.session)
        try:
            directory, endpoints = self.cluster.prepare(msgspec.json.encode(dataclasses.asdict(self.config)))
        except BaseException:  # the bundles and any started actor go back to the cluster
            self.cluster.stop()
            raise
        self.network = ZmqNetwork(directory, Codec(wire.Message))
        self._tcp = TcpTensorChannel(self.cluster.head.ip)
        self.codec = placed_codec(self.session, CONDUCTOR, endpoints, self._tcp)

    def _start_workers(self) -> None:
        if self.mode == "inproc":
            for rank in range(self.plan.num_workers):
                self._start_inproc_worker(rank)
            return
        args = {**self._build_args, "log_level": logging.getLogger().level or "WARNING"}
        if self.cluster is not None:
            self.workers = dict(self.cluster.actors)
            self.cluster.serve(args)
            threading.Thread(target=self.cluster.watch, args=(self._worker_down, lambda: self._stopping),
                             daemon=True, name="mstar-watchdog").start()
            return
        config_json = msgspec.json.encode(dataclasses.asdict(self.config))
        directory_json = msgspec.json.encode(self.network.directory)
        self._process_args = (config_json, directory_json, self.session, args, self._rendezvous())
        self._cpu_threads = self._thread_shares()
        for rank in range(self.plan.num_workers):
            self.workers[rank] = self._spawn(rank)
        threading.Thread(target=self._watch_processes, daemon=True, name="mstar-watchdog").start()

    def _start_inproc_worker(self, rank: int) -> None:
        """Build rank's engines and run its worker on a thread of its own, returning once they are built
        (a build error is raised here). The engines are built on that thread because a CPU thread pool
        belongs to the thread that first runs parallel work: built here, the main thread would hold a
        second OpenMP pool, and libgomp puts every pool's threads to sleep between kernels once they
        outnumber the cores, which slows CPU decode by a third."""
        built: queue.SimpleQueue = queue.SimpleQueue()

        def serve() -> None:
            try:
                device = worker_device(self.config, rank)
                use_device(device)  # this thread's: the worker runs its engines on it
                engines = build_engines(self.model, self.config, self.plan.components_on(rank), device)
                worker = Worker(rank, self.graph, engines, self.network.inbox(worker_peer(rank)),
                                self.network.outbox(), self.codec, device)
            except BaseException as exc:  # handed to the starting thread, which raises it
                built.put(exc)
                return
            built.put((worker, context_lens(engines)))
            try:
                worker.run()
            except BaseException as exc:  # nothing else watches a thread: its requests would wait forever
                if not self._stopping:
                    logger.exception("in-process worker %d stopped", rank)
                    self._inproc_worker_died(rank, f"stopped: {type(exc).__name__}: {exc}")

        thread = threading.Thread(target=serve, daemon=True, name=f"mstar-worker-{rank}")
        thread.start()
        result = built.get()
        if isinstance(result, BaseException):
            thread.join()
            raise result
        worker, lens = result
        self._limit_context(lens)
        self.workers[rank] = worker
        self._threads.append(thread)
        self._ready.add(rank)

    def _thread_shares(self) -> dict[int, int]:
        """Rank -> intra-op threads of each worker process (`cpu_thread_shares`): CPU workers at one
        thread per core would oversubscribe the host, and a rank spinning in a collective would starve
        the others; a GPU worker's idle pool threads would spin on the cores the server needs."""
        from mstar.runtime.process import cpu_thread_shares, host_cores

        devices = [worker_device(self.config, rank).type for rank in range(self.plan.num_workers)]
        omp = os.environ.get("OMP_NUM_THREADS")  # OpenMP's own variable, which spawned workers inherit
        shares = cpu_thread_shares(devices, host_cores(), omp)
        if shares:
            logger.info("worker processes' intra-op threads (rank: threads): %s", shares)
        elif omp:
            logger.info("worker processes keep OMP_NUM_THREADS=%s", omp)
        return shares

    def _spawn(self, rank: int) -> mp.process.BaseProcess:
        from mstar.runtime.process import worker_process_main

        config_json, directory_json, session, args, rendezvous = self._process_args
        proc = mp.get_context("spawn").Process(
            target=worker_process_main, name=f"mstar-worker-{rank}", daemon=True,
            args=(rank, config_json, directory_json, session, dict(args), rendezvous, self._cpu_threads.get(rank)))
        proc.start()
        return proc

    def _limit_context(self, lens: dict[str, int]) -> None:
        """Hand the processor the limit the engine of the model's context component enforces."""
        component = type(self.model).context_component
        if component in lens:
            self.processor.limit_context(lens[component])

    def _rendezvous(self) -> list[Any] | None:
        """[host, port, world size] where the workers join torch.distributed; None without multi-rank replicas."""
        if not multi_rank_replicas(self.plan):
            return None
        import socket

        with socket.socket() as sock:  # a free port now; the rank-0 worker binds it moments later
            sock.bind(("127.0.0.1", 0))
            return ["127.0.0.1", sock.getsockname()[1], self.plan.num_workers]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if self._failure is not None:
                self.shutdown()
                raise RuntimeError(f"a worker failed to start:\n{self._failure}")
            if time.monotonic() > deadline:
                self.shutdown()
                raise TimeoutError(f"workers not ready after {timeout_s:.0f} s: ready ranks {sorted(self._ready)}")
            time.sleep(0.01)

    _failure: str | None = None

    def _receive_loop(self) -> None:
        while not self._stopping:
            msg = self._inbox.recv(0.1)
            if msg is None:
                continue
            self._last_message = time.monotonic()
            try:
                if isinstance(msg, wire.WorkerReady):
                    self._limit_context(msg.context_lens)
                    self._ready.add(msg.rank)
                    self.conductor.worker_revived(msg.rank)
                elif isinstance(msg, wire.WorkerFailed):
                    self._failure = f"worker {msg.rank}: {msg.error}"
                else:
                    self.conductor.handle(msg)
            except Exception:  # the conductor thread must survive any one message
                logger.exception("conductor failed handling %s", type(msg).__name__)

    def _watch_processes(self) -> None:
        """Reap each worker process that exits, fail its requests, and restart it (see supervisor.py)."""
        from multiprocessing.connection import wait

        while not self._stopping:
            watched = {proc.sentinel: rank for rank, proc in list(self.workers.items()) if rank not in self._down}
            if not watched:  # every worker waits for its restart
                time.sleep(0.5)
                continue
            for sentinel in wait(list(watched), timeout=0.5):
                if self._stopping:
                    return
                self._worker_exited(watched[sentinel])

    def _worker_exited(self, rank: int) -> None:
        proc = self.workers[rank]
        proc.join(timeout=5)  # reaps it: no zombie, and the exit code (or signal) is known
        self._worker_down(rank, exit_reason(proc.exitcode))

    def _inproc_worker_died(self, rank: int, reason: str) -> None:
        """A worker thread ended with an error: its engines' state is unknown and a thread cannot be
        restarted like a process, so every request fails and the runtime gives up (the server exits)."""
        self._ready.discard(rank)
        self._down.add(rank)
        self.conductor.worker_died(rank, reason)
        self.conductor.fail_all(f"worker {rank} {reason}; the server is stopping", 503)
        self._give_up(f"in-process worker {rank} {reason}")

    def _worker_down(self, rank: int, reason: str) -> None:
        """Fail the dead worker's requests and restart it with backoff, or give up."""
        logger.error("worker %d %s", rank, reason)
        self._ready.discard(rank)
        self._down.add(rank)
        self.conductor.worker_died(rank, reason)
        if any(rank in replica for reps in multi_rank_replicas(self.plan).values() for replica in reps):
            self._give_up(f"worker {rank} {reason}; it belongs to a multi-rank replica, which cannot take a "
                          "new rank while running")
            return
        delay = self._restarts.next_delay(rank)
        if delay is None:
            self._give_up(f"worker {rank} {reason}, the {self._restarts.limit}th time within "
                          f"{self._restarts.window_s:.0f} s")
            return
        logger.warning("restarting worker %d in %.1f s", rank, delay)
        threading.Timer(delay, self._restart, (rank,)).start()

    def _restart(self, rank: int) -> None:
        if self._stopping:
            return
        if self.cluster is not None:
            try:
                self.cluster.restart(rank)
            except Exception as exc:  # a restart that cannot happen ends the runtime, as dying too often does
                logger.exception("could not restart worker %d", rank)
                self._give_up(f"worker {rank} could not be restarted: {exc}")
                return
            self.workers[rank] = self.cluster.actors[rank]
        else:
            self.workers[rank] = self._spawn(rank)
        self._down.discard(rank)

    def _give_up(self, reason: str) -> None:
        logger.critical("giving up: %s", reason)
        self.fatal = reason
        for callback in self._on_fatal:
            callback()
