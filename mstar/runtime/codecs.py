"""How tensors ride in messages: by reference in one process, as payloads across processes.

`pack(value, to)` names the receiver: a worker rank, or None for the API process (conductor).
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

import torch

from mstar.transport.placed_channels import (
    CUDA_IPC,
    SHM,
    TCP,
    Endpoint,
    PlacedTensorChannel,
    needed_kinds,
)
from mstar.transport.tensor_channels import ShmTensorChannel, TensorChannel

if TYPE_CHECKING:
    from mstar.transport.tcp_tensors import TcpTensorChannel
from mstar.worker.worker import CONDUCTOR, worker_peer


class LocalCodec:
    """In-process mode: tensors travel as themselves (GPU tensors stay on their device)."""

    def pack(self, value: Any, to: int | None) -> Any:
        return value

    def unpack(self, value: Any) -> Any:
        return value

    def discard(self, value: Any) -> None:
        pass


class PayloadCodec:
    """Across processes: each tensor through the channel its edge gets from placement
    (transport.placed_channels); without `channel`, every tensor through host shared memory."""

    def __init__(self, session: str, channel: TensorChannel | None = None) -> None:
        self.channel = channel or ShmTensorChannel(session)

    def pack(self, value: torch.Tensor, to: int | None) -> Any:
        return self.channel.pack(value, CONDUCTOR if to is None else worker_peer(to))

    def unpack(self, value: Any) -> torch.Tensor:
        return self.channel.unpack(value)

    def discard(self, value: Any) -> None:
        self.channel.discard(value)


def worker_codec(session: str, rank: int, devices: list[torch.device]) -> PayloadCodec:
    """The codec of worker `rank` of a one-host run whose ranks run on `devices` (the API process on the
    host): GPU tensors between GPU workers by CUDA IPC, everything else by shared memory."""
    host = socket.gethostname()
    endpoints = {CONDUCTOR: Endpoint(host, "cpu")}
    endpoints |= {worker_peer(r): Endpoint(host, d.type) for r, d in enumerate(devices)}
    me = worker_peer(rank)
    kinds = needed_kinds(me, endpoints)
    assert kinds <= {SHM, CUDA_IPC}, f"one host needs no {kinds - {SHM, CUDA_IPC}}"
    return placed_codec(session, me, endpoints)


def placed_codec(session: str, me: str, endpoints: dict[str, Endpoint],
                 tcp: TcpTensorChannel | None = None) -> PayloadCodec:
    """The codec of process `me` among `endpoints` (every process's host and device): it builds the
    channels its edges need, and sends through `tcp` where an edge leaves the host. GPU tensors between
    hosts go through host memory over TCP too: no launcher sets up a NCCL group for tensor edges."""
    kinds = needed_kinds(me, endpoints)
    channels: dict[str, TensorChannel] = {SHM: ShmTensorChannel(session)}
    if CUDA_IPC in kinds:
        from mstar.transport.cuda_ipc import CudaIpcTensorChannel

        channels[CUDA_IPC] = CudaIpcTensorChannel(session)
    if TCP in kinds:
        assert tcp is not None, f"{me} sends tensors to another host: give it a TCP tensor channel"
        channels[TCP] = tcp
    return PayloadCodec(session, PlacedTensorChannel(me, endpoints, channels))
