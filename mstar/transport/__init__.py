"""Transport: moves control messages and tensors between processes; knows nothing of models.

- `messages`: the `Message` base struct, `Codec` (msgspec msgpack), payload walking;
- `tensors`: `TensorPayload`, inline / shared-memory packing of host tensors;
- `tensor_channels`: the `TensorChannel` seam and its shared-memory default;
- `cuda_ipc`, `dist_tensors`, `tcp_tensors`: CUDA IPC, torch.distributed (NCCL) and TCP channels;
- `placed_channels`: the channel of each edge, chosen from where its ends run;
- `channels`: `Inbox` / `Outbox` / `Network`, in-process queues and `make_network`;
- `zmq_channels`: the ZMQ (ipc, tcp) implementation.
"""

from mstar.transport.channels import Inbox, InprocNetwork, Network, Outbox, PeerUnavailable, make_network
from mstar.transport.messages import Codec, Message, discard_message, iter_payloads
from mstar.transport.tensor_channels import ShmTensorChannel, TensorChannel
from mstar.transport.tensors import (
    TensorPayload,
    cleanup_segments,
    discard_payload,
    list_segments,
    new_session_id,
    pack_tensor,
    session_id,
    unpack_tensor,
)

__all__ = [
    "Codec",
    "Inbox",
    "InprocNetwork",
    "Message",
    "Network",
    "Outbox",
    "PeerUnavailable",
    "ShmTensorChannel",
    "TensorChannel",
    "TensorPayload",
    "cleanup_segments",
    "discard_message",
    "discard_payload",
    "iter_payloads",
    "list_segments",
    "make_network",
    "new_session_id",
    "pack_tensor",
    "session_id",
    "unpack_tensor",
]
