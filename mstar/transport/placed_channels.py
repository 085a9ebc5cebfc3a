"""Choosing a tensor channel per edge from where its two ends run (placement), and routing by it.

| ends of the edge            | GPU tensors   | host tensors   |
| --------------------------- | ------------- | -------------- |
| one host, both on GPUs      | CUDA IPC      | shared memory  |
| one host, otherwise         | shared memory | shared memory  |
| two hosts, both on GPUs     | TCP (NCCL)    | TCP            |
| two hosts, otherwise        | TCP           | TCP            |

GPU tensors between hosts take NCCL only where the launcher has paired the two processes in a NCCL
group (`nccl=True`); no launcher does yet, so they go through host memory by TCP. Otherwise a GPU
tensor is copied to the host only where an end has no GPU. `PlacedTensorChannel` is one
process's channel to all its peers: it decides every edge when built (and logs each choice once),
packs each tensor with the channel its edge and device call for, and unpacks a payload with the
channel its type names.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from mstar.transport.cuda_ipc import CudaIpcPayload
from mstar.transport.dist_tensors import DistPayload
from mstar.transport.tcp_tensors import TcpPayload
from mstar.transport.tensors import TensorPayload

if TYPE_CHECKING:
    import torch

    from mstar.transport.tensor_channels import TensorChannel

logger = logging.getLogger(__name__)

SHM, CUDA_IPC, NCCL, TCP = "shm", "cuda_ipc", "nccl", "tcp"
AnyPayload = TensorPayload | CudaIpcPayload | TcpPayload | DistPayload
PAYLOAD_TYPES = (TensorPayload, CudaIpcPayload, TcpPayload, DistPayload)
_KIND_OF_PAYLOAD = {TensorPayload: SHM, CudaIpcPayload: CUDA_IPC, TcpPayload: TCP, DistPayload: NCCL}


class Endpoint(msgspec.Struct, frozen=True):
    """Where one process runs, as placement knows it."""

    host: str  # host name or address; equal strings mean one machine
    device: str  # "cuda" or "cpu": where the process's tensors live


class EdgeTransport(NamedTuple):
    """The channel kinds of one edge: for GPU tensors and for host tensors."""

    gpu: str
    host: str


def choose_transport(src: Endpoint, dst: Endpoint, nccl: bool = False) -> EdgeTransport:
    """The channels for tensors sent from `src` to `dst` (the table in the module docstring); `nccl`
    says whether a NCCL group pairs GPU processes on different hosts."""
    both_gpu = src.device == "cuda" and dst.device == "cuda"
    if src.host == dst.host:
        return EdgeTransport(CUDA_IPC if both_gpu else SHM, SHM)
    return EdgeTransport(NCCL if both_gpu and nccl else TCP, TCP)


def needed_kinds(me: str, endpoints: dict[str, Endpoint], nccl: bool = False) -> set[str]:
    """The channel kinds process `me` sends with, so a launcher builds only those (and always shm,
    which also unpacks inline payloads)."""
    kinds = {SHM}
    for peer, end in endpoints.items():
        if peer != me:
            kinds.update(choose_transport(endpoints[me], end, nccl))
    return kinds


class PlacedTensorChannel:
    """A TensorChannel to every peer in `endpoints`, through `channels` (kind -> channel, holding at
    least the kinds `needed_kinds` names); `nccl` as for `choose_transport`."""

    def __init__(self, me: str, endpoints: dict[str, Endpoint], channels: dict[str, TensorChannel],
                 nccl: bool = False) -> None:
        self.channels = channels
        self.edges = {peer: choose_transport(endpoints[me], end, nccl)
                      for peer, end in endpoints.items() if peer != me}
        for peer, edge in self.edges.items():
            missing = {edge.gpu, edge.host} - channels.keys()
            if missing:
                raise ValueError(f"tensors {me} -> {peer} need channels {sorted(missing)}; built: {sorted(channels)}")
            logger.info("tensors %s -> %s: GPU tensors by %s, host tensors by %s", me, peer, edge.gpu, edge.host)

    def pack(self, tensor: torch.Tensor, peer: str) -> AnyPayload:
        edge = self.edges.get(peer)
        if edge is None:
            raise KeyError(f"no tensor edge to {peer!r}: placement knows {sorted(self.edges)}")
        return self.channels[edge.gpu if tensor.device.type == "cuda" else edge.host].pack(tensor, peer)

    def unpack(self, payload: AnyPayload) -> torch.Tensor:
        return self.channels[_KIND_OF_PAYLOAD[type(payload)]].unpack(payload)

    def discard(self, payload: AnyPayload) -> None:
        self.channels[_KIND_OF_PAYLOAD[type(payload)]].discard(payload)

    def cleanup(self) -> int:
        return sum(channel.cleanup() for channel in self.channels.values())
