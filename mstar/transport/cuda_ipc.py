"""GPU tensors between processes of one host by CUDA IPC: the bytes never leave the device.

`pack` copies the tensor into a fresh contiguous block on its device (the caller may reuse its
tensor at once) and shares that block through torch's CUDA IPC (`UntypedStorage._share_cuda_`);
the `CudaIpcPayload` carries the IPC memory handle, torch's reference-counter slot and the event
that orders the copy before any read. `unpack` maps the block in the receiving process
(`_new_shared_cuda`): the tensor lives on the sender's device and shares its memory.

Lifetime, by torch's cross-process reference counting: sharing sets a counter in host shared
memory; the sender drops its own reference right after `pack`, and torch's caching allocator then
parks the block ("limbo") instead of reusing it while the counter is set. The receiver's tensor
clears the counter when it is freed, and `discard` clears it without mapping; the block returns to
the sender's allocator at its next IPC collection (`torch.cuda.ipc_collect`, run by `cleanup` and
by the allocator itself when it runs short). No ack message is needed: the counter is the ack. Each
payload is one share, consumed by exactly one `unpack` or `discard`; a payload cannot be unpacked in
the process that packed it (CUDA cannot open its own handle).

Host tensors fall through to shared memory (`ShmTensorChannel`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from mstar.transport.tensor_channels import ShmTensorChannel
from mstar.transport.tensors import DEFAULT_INLINE_MAX_BYTES, TensorPayload, dtype_from_name, dtype_name

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class CudaIpcPayload(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """A contiguous GPU tensor shared by CUDA IPC; the fields are torch's `_share_cuda_` tuple."""

    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    device: int  # the sender's CUDA device index: the tensor stays there
    handle: bytes  # cudaIpcMemHandle of the allocation holding the block; empty for an empty tensor
    storage_nbytes: int
    storage_offset_bytes: int  # where the block starts in that allocation
    ref_counter: bytes  # torch's shared-memory counter file and slot that keep the block alive
    ref_counter_offset: int
    event_handle: bytes  # IPC event recorded after the copy; the receiver waits on it
    event_sync_required: bool


class CudaIpcTensorChannel:
    """GPU tensors by CUDA IPC, host tensors by shared memory; see the module docstring."""

    def __init__(self, session: str | None = None, inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES) -> None:
        self.host = ShmTensorChannel(session, inline_max_bytes)

    def pack(self, tensor: torch.Tensor, peer: str) -> TensorPayload | CudaIpcPayload:
        import torch

        t = tensor.detach()
        if t.device.type != "cuda":
            return self.host.pack(t, peer)
        dtype, shape = dtype_name(t), tuple(t.shape)
        if t.numel() == 0:
            return CudaIpcPayload(dtype, shape, t.device.index, b"", 0, 0, b"", 0, b"", False)
        block = t.clone(memory_format=torch.contiguous_format)
        device, handle, size, offset, counter, counter_offset, event, sync = block.untyped_storage()._share_cuda_()
        # torch gives no event handle where it synchronized the stream instead (event_sync_required False)
        return CudaIpcPayload(dtype, shape, device, handle, size, offset, counter, counter_offset, event or b"",
                              bool(sync))

    def unpack(self, payload: TensorPayload | CudaIpcPayload) -> torch.Tensor:
        import torch

        if isinstance(payload, TensorPayload):
            return self.host.unpack(payload)
        dtype = dtype_from_name(payload.dtype)
        if not payload.handle:
            return torch.empty(payload.shape, dtype=dtype, device=f"cuda:{payload.device}")
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            payload.device, payload.handle, payload.storage_nbytes, payload.storage_offset_bytes,
            payload.ref_counter, payload.ref_counter_offset, payload.event_handle, payload.event_sync_required)
        return torch.empty(0, dtype=dtype, device=f"cuda:{payload.device}").set_(storage, 0, payload.shape)

    def discard(self, payload: TensorPayload | CudaIpcPayload) -> None:
        if isinstance(payload, TensorPayload):
            self.host.discard(payload)
        else:
            release_ipc_payload(payload)

    def cleanup(self) -> int:
        """Free this session's shared-memory segments and hand released GPU blocks back to the allocator."""
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()
        return self.host.cleanup()


def release_ipc_payload(payload: CudaIpcPayload) -> None:
    """Clear the counter of a payload that will never be unpacked, so its sender can free the block."""
    import torch

    if payload.handle:
        torch.UntypedStorage._release_ipc_counter(payload.ref_counter, payload.ref_counter_offset,
                                                  device=f"cuda:{payload.device}")
