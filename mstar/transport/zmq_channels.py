"""ZMQ control channels: PUSH/PULL, one msgpack frame per message.

Each inbox binds a PULL socket at its name's endpoint; an outbox connects one PUSH socket per peer,
lazily on the first send, so ordering per (outbox, peer) is ZMQ's per-pipe FIFO order. Socket
choices, and why:
- LINGER 0: closing a socket or the network never waits for a dead peer to drain.
- IMMEDIATE off (ZMQ's default): a connect pipe exists before the peer binds, so a process can send
  to a peer that is still starting; messages wait in the pipe.
- SNDHWM `send_hwm` messages per peer: room for bursts (token streams) without unbounded memory.
  When a peer stops reading (dead or stuck) the pipe fills, `send` then waits at most
  `send_timeout_s` (SNDTIMEO) and raises PeerUnavailable. Noticing a dead process quickly is the
  supervisor's job; the transport only promises never to block forever.
- One frame per message: tensors above the inline limit go through shared memory, so frames stay
  small and a multi-part zero-copy send would only add code (see benchmarks/transport_hops.py).
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import zmq

from mstar.transport.channels import PeerUnavailable
from mstar.transport.messages import Codec, discard_message

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_MAX_IPC_PATH = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux


class Directory(msgspec.Struct, frozen=True):
    """Where each named inbox listens. Plain data: pass it to child processes (or encode it as JSON)
    and they rebuild the network with `ZmqNetwork(directory, codec)`."""

    mode: str  # "ipc" or "tcp"
    run_dir: str = ""  # ipc: sockets are <run_dir>/<name>.sock
    host: str = "127.0.0.1"  # tcp: every peer listens on this host...
    port_base: int = 0  # ...at port_base + its index in `peers`
    peers: tuple[str, ...] = ()
    addresses: dict[str, str] = {}  # tcp across hosts: each peer's own endpoint, e.g. "tcp://10.0.0.5:41234"

    @classmethod
    def ipc(cls, run_dir: str | None = None) -> Directory:
        """Unix sockets under `run_dir` (created if missing; a fresh temp dir if None)."""
        path = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="mstar-run-"))
        path.mkdir(parents=True, exist_ok=True)
        return cls("ipc", run_dir=str(path))

    @classmethod
    def tcp(cls, host: str, port_base: int, peers: tuple[str, ...]) -> Directory:
        """TCP on one host; peer `peers[i]` listens on `port_base + i`."""
        if port_base <= 0 or not peers:
            raise ValueError(f"tcp transport needs port_base > 0 and the peer names, got {port_base}, {peers}")
        return cls("tcp", host=host, port_base=port_base, peers=tuple(peers))

    @classmethod
    def tcp_addresses(cls, addresses: dict[str, str]) -> Directory:
        """TCP across hosts: peer `name` listens at `addresses[name]` ("tcp://host:port")."""
        if not addresses or not all(a.startswith("tcp://") for a in addresses.values()):
            raise ValueError(f"tcp addresses must be a non-empty mapping of names to tcp:// endpoints, got {addresses}")
        return cls("tcp", peers=tuple(addresses), addresses=dict(addresses))

    def endpoint(self, name: str) -> str:
        """The ZMQ endpoint of inbox `name`."""
        if not _NAME_RE.fullmatch(name):
            raise ValueError(f"invalid peer name {name!r}: use 1-64 characters from [A-Za-z0-9_.:-]")
        if self.mode == "tcp":
            if name in self.addresses:
                return self.addresses[name]
            if name not in self.peers:
                raise ValueError(f"unknown tcp peer {name!r}: the directory lists {self.peers}")
            return f"tcp://{self.host}:{self.port_base + self.peers.index(name)}"
        path = f"{self.run_dir}/{name}.sock"
        if len(path.encode()) > _MAX_IPC_PATH:
            raise ValueError(f"ipc socket path {path!r} exceeds {_MAX_IPC_PATH} bytes: use a shorter run_dir")
        return f"ipc://{path}"


class ZmqNetwork:
    """Inboxes and outboxes over ZMQ for one process; see the module docstring for the guarantees."""

    def __init__(
        self,
        directory: Directory,
        codec: Codec,
        *,
        send_hwm: int = 10_000,
        send_timeout_s: float = 5.0,
        owns_run_dir: bool = False,
    ) -> None:
        self.directory, self.codec = directory, codec
        self.send_hwm, self.send_timeout_s = send_hwm, send_timeout_s
        self._owns_run_dir = owns_run_dir
        self._ctx = zmq.Context()

    def inbox(self, name: str) -> ZmqInbox:
        """Bind a PULL socket for `name` (names are unique per network: ZMQ lets a later ipc bind
        silently take over the path)."""
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.send_hwm)
        endpoint = self.directory.endpoint(name)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise RuntimeError(f"cannot bind inbox {name!r} at {endpoint}: {exc}") from exc
        return ZmqInbox(name, sock, self.codec)

    def outbox(self) -> ZmqOutbox:
        """A new sender; use it from one thread."""
        return ZmqOutbox(self)

    def close(self) -> None:
        """Close every socket of this network at once (LINGER 0) and remove an owned run dir."""
        self._ctx.destroy(linger=0)
        if self._owns_run_dir and self.directory.mode == "ipc":
            shutil.rmtree(self.directory.run_dir, ignore_errors=True)

    def _connect(self, peer: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.send_hwm)
        sock.setsockopt(zmq.SNDTIMEO, int(self.send_timeout_s * 1000))
        sock.connect(self.directory.endpoint(peer))
        return sock


class ZmqInbox:
    """PULL side of one name; decodes with the network's codec."""

    def __init__(self, name: str, sock: zmq.Socket, codec: Codec) -> None:
        self.name, self._sock, self._codec = name, sock, codec
        # one Poller kept for the socket: `Socket.poll` builds a new one per call (a busy worker
        # polls with timeout 0 once per loop turn)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)

    def recv(self, timeout_s: float | None = None) -> Any | None:
        """The next message, or None after `timeout_s` (None: wait forever)."""
        if timeout_s is not None and not self._poller.poll(int(timeout_s * 1000)):
            return None
        return self._codec.decode(self._sock.recv())

    def close(self) -> None:
        """Unbind; queued messages are dropped (their shm segments go at cleanup_segments)."""
        self._sock.close(linger=0)


class ZmqOutbox:
    """PUSH sockets, one per peer, connected on first use."""

    def __init__(self, network: ZmqNetwork) -> None:
        self._network = network
        self._socks: dict[str, zmq.Socket] = {}

    def send(self, peer: str, msg: Any) -> None:
        """Encode and queue `msg` for `peer`; PeerUnavailable if its pipe stays full too long."""
        sock = self._socks.get(peer)
        if sock is None:
            sock = self._socks[peer] = self._network._connect(peer)
        try:
            sock.send(self._network.codec.encode(msg))
        except zmq.Again:
            discard_message(msg)
            raise PeerUnavailable(
                f"peer {peer!r} took no message for {self._network.send_timeout_s}s with "
                f"{self._network.send_hwm} queued: is it alive?"
            ) from None

    def close(self) -> None:
        """Close the sockets without waiting for undelivered messages."""
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
