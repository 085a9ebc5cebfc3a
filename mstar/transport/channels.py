"""Control channels: one interface, an in-memory implementation, and a factory.

Every process owns `Inbox`es (named, receive side) and `Outbox`es (send side, addressed by peer
name). A `Network` hands out both and knows where each name lives. Guarantees, for every mode:
- messages from one outbox to one peer arrive in send order;
- `send` never blocks forever: when a peer cannot take a message in time it raises
  `PeerUnavailable` after releasing the message's shared-memory payloads;
- a peer may be sent to before its inbox exists (processes start in any order).
Inboxes and outboxes are meant for one thread each (ZMQ sockets are not thread-safe).

Modes: "inproc" (queues, messages passed as objects, no encoding: the in-process mode), "ipc"
(ZMQ PUSH/PULL over unix sockets in a run directory) and "tcp" (ZMQ over TCP, one port per peer).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Protocol

from mstar.transport.messages import Codec, discard_message

logger = logging.getLogger(__name__)

MODES = ("inproc", "ipc", "tcp")


class PeerUnavailable(RuntimeError):
    """A message could not be handed to a peer in time (dead, closed or far behind)."""


class Inbox(Protocol):
    """The receive side of one named endpoint."""

    name: str

    def recv(self, timeout_s: float | None = None) -> Any | None:
        """The next message, or None if none arrived within `timeout_s` (None: wait forever)."""
        ...

    def close(self) -> None:
        """Stop receiving; messages not yet received are dropped."""
        ...


class Outbox(Protocol):
    """The send side: delivers messages to inboxes by name, in order per peer."""

    def send(self, peer: str, msg: Any) -> None:
        """Queue `msg` for `peer`; raises PeerUnavailable (payloads released) if it cannot."""
        ...

    def close(self) -> None:
        """Release sockets; messages still queued for unreachable peers are dropped."""
        ...


class Network(Protocol):
    """Creates inboxes and outboxes of one mode; one per process (or one shared, for inproc)."""

    def inbox(self, name: str) -> Inbox:
        """Start receiving messages addressed to `name` in this process."""
        ...

    def outbox(self) -> Outbox:
        """A new sender (one per thread)."""
        ...

    def close(self) -> None:
        """Close everything this network created."""
        ...


class InprocNetwork:
    """Inboxes are unbounded queues in this process; messages are passed as objects, not encoded.
    Thread-safe. Sending to a closed inbox raises PeerUnavailable."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._claimed: set[str] = set()
        self._closed: set[str] = set()

    def inbox(self, name: str) -> InprocInbox:
        with self._lock:
            if name in self._claimed:
                raise ValueError(f"inbox {name!r} already exists in this network: names must be unique")
            self._claimed.add(name)
            self._closed.discard(name)
        return InprocInbox(name, self._queue(name), self)

    def outbox(self) -> InprocOutbox:
        return InprocOutbox(self)

    def close(self) -> None:
        with self._lock:
            self._closed |= self._claimed

    def _queue(self, name: str) -> queue.SimpleQueue:
        with self._lock:
            return self._queues.setdefault(name, queue.SimpleQueue())

    def _deliver(self, peer: str, msg: Any) -> None:
        if peer in self._closed:
            discard_message(msg)
            raise PeerUnavailable(f"inbox {peer!r} is closed")
        # Lock-free read first: one dict get is atomic, and the lock is only needed to create a queue.
        q = self._queues.get(peer)
        (q if q is not None else self._queue(peer)).put(msg)

    def _close_inbox(self, name: str) -> None:
        with self._lock:
            self._closed.add(name)
            self._claimed.discard(name)
            self._queues.pop(name, None)  # drop what it never received


class InprocInbox:
    """Receive side of an InprocNetwork name."""

    def __init__(self, name: str, q: queue.SimpleQueue, network: InprocNetwork) -> None:
        self.name, self._queue, self._network = name, q, network

    def recv(self, timeout_s: float | None = None) -> Any | None:
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._network._close_inbox(self.name)


class InprocOutbox:
    """Send side of an InprocNetwork: never blocks (queues are unbounded)."""

    def __init__(self, network: InprocNetwork) -> None:
        self._network = network

    def send(self, peer: str, msg: Any) -> None:
        self._network._deliver(peer, msg)

    def close(self) -> None:
        pass


def make_network(
    mode: str,
    codec: Codec | None = None,
    *,
    run_dir: str | None = None,
    host: str = "127.0.0.1",
    port_base: int = 0,
    peers: tuple[str, ...] = (),
) -> Network:
    """A network of `mode`: "inproc" needs nothing; "ipc" needs `codec` and uses `run_dir` (a fresh
    temp dir if None); "tcp" needs `codec`, `port_base` and the ordered `peers` (port = base + index).
    Other processes rebuild the same network with `ZmqNetwork(network.directory, codec)`."""
    if mode == "inproc":
        return InprocNetwork()
    if mode not in MODES:
        raise ValueError(f"unknown transport mode {mode!r}: expected one of {MODES}")
    if codec is None:
        raise ValueError(f"transport mode {mode!r} encodes messages: pass codec=Codec(YourMessageUnion)")
    from mstar.transport.zmq_channels import Directory, ZmqNetwork

    if mode == "ipc":
        return ZmqNetwork(Directory.ipc(run_dir), codec, owns_run_dir=run_dir is None)
    return ZmqNetwork(Directory.tcp(host, port_base, peers), codec)
