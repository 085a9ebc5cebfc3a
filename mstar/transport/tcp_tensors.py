"""Host tensors between hosts: the receiver pulls the bytes from the sender over TCP (ZMQ).

`pack` keeps a C-contiguous copy of the tensor under a transfer id and returns a `TcpPayload` naming
the sender's data address and that id; small tensors ride inline as a `TensorPayload` instead. A
server thread of the sender answers requests on a ROUTER socket: `get` sends the bytes and forgets
them, `drop` forgets them unread. The receiver's `unpack` asks with a DEALER socket per sender and
receives straight into the new tensor's memory. Bytes are moved as bytes, so every dtype
(bfloat16, bool, complex, float8) arrives bit-exact.

torch and zmq are imported inside the functions that need them: importing this module is cheap.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import TYPE_CHECKING, Any

import msgspec

from mstar.transport.tensors import (
    DEFAULT_INLINE_MAX_BYTES,
    TensorPayload,
    dtype_from_name,
    dtype_name,
    pack_tensor,
    unpack_tensor,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_GET, _DROP = b"get", b"drop"


class TcpPayload(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """A host tensor held by its sender until the receiver pulls it from `address` by `transfer_id`."""

    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    nbytes: int
    address: str  # the sender's ZMQ ROUTER endpoint, e.g. "tcp://10.0.0.5:41234"
    transfer_id: int


class TcpTensorChannel:
    """Host tensors across hosts by pull over TCP; see the module docstring. `unpack` and `discard`
    are for one thread; `pack` may run on another. `close` stops the server thread."""

    def __init__(self, host: str = "127.0.0.1", bind_host: str | None = None, *, port: int = 0,
                 inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES, timeout_s: float = 30.0) -> None:
        """Serve on `bind_host` (default `host`) at `port` (0: any free port); payloads name `host`,
        which must be how receivers reach this process."""
        import zmq

        self.inline_max_bytes, self.timeout_s = inline_max_bytes, timeout_s
        self._ctx = zmq.Context()
        self._server = self._ctx.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.LINGER, 0)
        bind = f"tcp://{bind_host or host}"
        if port == 0:
            port = self._server.bind_to_random_port(bind)
        else:
            self._server.bind(f"{bind}:{port}")
        self.address = f"tcp://{host}:{port}"
        self._held: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._clients: dict[str, Any] = {}  # sender address -> DEALER socket
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="mstar-tcp-tensors")
        self._thread.start()

    def pack(self, tensor: torch.Tensor, peer: str) -> TensorPayload | TcpPayload:
        import torch

        t = tensor.detach()
        nbytes = t.numel() * t.element_size()
        if nbytes <= self.inline_max_bytes:
            return pack_tensor(t, inline_max_bytes=self.inline_max_bytes)
        # a copy of our own: the caller may reuse `tensor` as soon as this returns
        held = t.to("cpu", copy=True, memory_format=torch.contiguous_format)
        transfer_id = next(self._ids)
        with self._lock:
            self._held[transfer_id] = held
        return TcpPayload(dtype_name(t), tuple(t.shape), nbytes, self.address, transfer_id)

    def unpack(self, payload: TensorPayload | TcpPayload) -> torch.Tensor:
        import torch

        if isinstance(payload, TensorPayload):
            return unpack_tensor(payload)
        sock = self._client(payload.address)
        sock.send_multipart([_GET, payload.transfer_id.to_bytes(8, "little")])
        out = torch.empty(payload.shape, dtype=dtype_from_name(payload.dtype))
        while True:
            reply_id, found = self._recv(sock, payload), sock.rcvmore
            if reply_id != payload.transfer_id:  # the answer to an earlier, abandoned request: skip it
                if found:
                    sock.recv()
                continue
            if not found:
                raise KeyError(f"tensor transfer {payload.transfer_id} is unknown at {payload.address}: "
                               f"a TCP payload can be unpacked once, and not after discard or cleanup")
            got = sock.recv_into(out.view(-1).view(torch.uint8).numpy())
            assert got == payload.nbytes, f"got {got} bytes of {payload.nbytes} from {payload.address}"
            return out

    def discard(self, payload: TensorPayload | TcpPayload) -> None:
        if isinstance(payload, TcpPayload):
            self._client(payload.address).send_multipart([_DROP, payload.transfer_id.to_bytes(8, "little")])

    def cleanup(self) -> int:
        """Forget every tensor no receiver pulled; returns how many."""
        with self._lock:
            count = len(self._held)
            self._held.clear()
        return count

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)

    def _client(self, address: str) -> Any:
        import zmq

        sock = self._clients.get(address)
        if sock is None:
            sock = self._clients[address] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        return sock

    def _recv(self, sock: Any, payload: TcpPayload) -> int:
        if not sock.poll(int(self.timeout_s * 1000)):
            raise TimeoutError(f"no answer from {payload.address} for tensor transfer {payload.transfer_id} "
                               f"within {self.timeout_s}s: is the sender alive?")
        return int.from_bytes(sock.recv(), "little")

    def _serve(self) -> None:
        """Server thread: answer `get` with [id, bytes] (or [id] when unknown); `drop` forgets."""
        import torch

        while not self._stop.is_set():
            if not self._server.poll(100):
                continue
            client, op, raw_id = self._server.recv_multipart()
            with self._lock:
                held = self._held.pop(int.from_bytes(raw_id, "little"), None)
            if op == _GET:
                frames = [client, raw_id] if held is None else [client, raw_id, held.view(-1).view(torch.uint8).numpy()]
                self._server.send_multipart(frames, copy=False)
