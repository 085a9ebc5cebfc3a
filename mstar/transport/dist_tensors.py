"""Tensors by torch.distributed point-to-point: NCCL between GPUs, gloo between host tensors.

`pack` starts an asynchronous send (`isend`) of the tensor's bytes to the peer's rank and returns a
`DistPayload` (dtype, shape, the sender's rank and a per-pair sequence number); `unpack` receives
the bytes into a new tensor on this channel's device. Bytes travel as uint8, so every dtype,
including those NCCL has no type for (bool, complex, float8), arrives bit-exact. Empty tensors send
nothing.

NCCL (and this channel, for both backends) pairs a send with a receive by order: payloads from one
sender must be unpacked or discarded in the order they were packed (the sequence number checks it;
`discard` receives and drops). Give the channel a process group of its own: a send waits on the
wire until its receive is posted and would hold up collectives queued behind it.
"""

from __future__ import annotations

import collections
import itertools
from typing import TYPE_CHECKING, Any

import msgspec

from mstar.transport.tensors import dtype_from_name, dtype_name

if TYPE_CHECKING:
    import torch


class DistPayload(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """A tensor on its way by torch.distributed send: receive `nbytes` bytes from `src`, in `seq` order."""

    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    nbytes: int
    src: int  # the sender's rank in the channel's group
    seq: int  # per (sender, receiver) pair, from 0; empty tensors take none


class DistTensorChannel:
    """Point-to-point sends on `group` (None: the default group); `ranks` maps peer names to ranks of
    that group. Received tensors are made on `device`. For one thread."""

    def __init__(self, ranks: dict[str, int], device: str | torch.device = "cpu", group: Any = None) -> None:
        import torch.distributed as dist

        self.ranks, self.device, self.group = ranks, device, group
        self.rank = dist.get_rank(group)
        self._next_send: dict[int, itertools.count] = {}
        self._next_recv: dict[int, int] = collections.defaultdict(int)
        self._in_flight: collections.deque = collections.deque()  # (work, tensor) kept until sent

    def pack(self, tensor: torch.Tensor, peer: str) -> DistPayload:
        import torch
        import torch.distributed as dist

        t = tensor.detach()
        dst = self.ranks[peer]
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return DistPayload(dtype_name(t), tuple(t.shape), 0, self.rank, -1)
        self._reap()
        # a copy of our own on the tensor's device: the caller may reuse `tensor` once this returns
        data = t.to(copy=True, memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)
        seq = next(self._next_send.setdefault(dst, itertools.count()))
        work = dist.isend(data, group=self.group, group_dst=dst)
        self._in_flight.append((work, data))
        return DistPayload(dtype_name(t), tuple(t.shape), nbytes, self.rank, seq)

    def unpack(self, payload: DistPayload) -> torch.Tensor:
        import torch

        dtype = dtype_from_name(payload.dtype)
        if payload.nbytes == 0:
            return torch.empty(payload.shape, dtype=dtype, device=self.device)
        return self._recv(payload).view(dtype).view(payload.shape)

    def discard(self, payload: DistPayload) -> None:
        if payload.nbytes:
            self._recv(payload)  # the send is paired by order: it must be received

    def cleanup(self) -> int:
        """Drop the sends still in flight (at shutdown); returns how many."""
        count = len(self._in_flight)
        self._in_flight.clear()
        return count

    def _recv(self, payload: DistPayload) -> torch.Tensor:
        import torch
        import torch.distributed as dist

        expected = self._next_recv[payload.src]
        if payload.seq != expected:
            raise RuntimeError(f"tensor {payload.seq} from rank {payload.src} consumed before {expected}: "
                               f"point-to-point payloads must be unpacked or discarded in the order sent")
        self._next_recv[payload.src] = expected + 1
        data = torch.empty(payload.nbytes, dtype=torch.uint8, device=self.device)
        dist.recv(data, group=self.group, group_src=payload.src)
        return data

    def _reap(self) -> None:
        while self._in_flight and self._in_flight[0][0].is_completed():
            self._in_flight.popleft()
