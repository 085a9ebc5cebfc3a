"""TensorChannel: how a tensor goes from one process to a peer, next to a control message.

The sender turns a tensor into a small tagged payload struct (`pack`) and puts it in a message; the
receiver turns the payload back into a tensor (`unpack`) or drops it (`discard`). The control
channel only ever carries the payload. Each mechanism has its own tagged payload struct:
- `ShmTensorChannel` (below, the default): host tensors, inline when small, else /dev/shm;
- `cuda_ipc.CudaIpcTensorChannel` (one host, GPU): an IPC handle; the tensor never leaves the device;
- `dist_tensors.DistTensorChannel` (GPUs on two hosts, not wired in by any launcher yet): torch.distributed
  send/recv (NCCL; gloo on CPU);
- `tcp_tensors.TcpTensorChannel` (two hosts; GPU tensors through host memory): a transfer id the receiver pulls;
- `placed_channels.PlacedTensorChannel`: one of those per edge, chosen from placement.
Contract for every implementation: after `pack` returns the sender may reuse its tensor; the
channel owns the bytes until exactly one `unpack` or `discard`; `cleanup` at shutdown frees what a
dead receiver left behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from mstar.transport.tensors import (
    DEFAULT_INLINE_MAX_BYTES,
    TensorPayload,
    cleanup_segments,
    discard_payload,
    pack_tensor,
    session_id,
    unpack_tensor,
)

if TYPE_CHECKING:
    import torch

    from mstar.transport.placed_channels import AnyPayload


class TensorChannel(Protocol):
    """Sends tensors to peers as payloads carried by control messages; see the module docstring."""

    def pack(self, tensor: torch.Tensor, peer: str) -> AnyPayload:
        """A payload for `peer` describing `tensor`; `tensor` may be reused once this returns."""
        ...

    def unpack(self, payload: AnyPayload) -> torch.Tensor:
        """The tensor; consumes the payload (at most once)."""
        ...

    def discard(self, payload: AnyPayload) -> None:
        """Free the payload without reading it (its message was dropped)."""
        ...

    def cleanup(self) -> int:
        """Free everything this channel's session still holds; returns how many buffers."""
        ...


class ShmTensorChannel:
    """Host tensors: inline up to `inline_max_bytes`, else one shared-memory segment each.
    Works between any processes of one host; GPU tensors are copied to the host for now."""

    def __init__(self, session: str | None = None, inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES) -> None:
        self.session = session_id(session)
        self.inline_max_bytes = inline_max_bytes

    def pack(self, tensor: torch.Tensor, peer: str) -> TensorPayload:
        return pack_tensor(tensor, inline_max_bytes=self.inline_max_bytes, session=self.session)

    def unpack(self, payload: TensorPayload) -> torch.Tensor:
        return unpack_tensor(payload)

    def discard(self, payload: TensorPayload) -> None:
        discard_payload(payload)

    def cleanup(self) -> int:
        return cleanup_segments(self.session)
