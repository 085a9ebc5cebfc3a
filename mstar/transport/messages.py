"""Machinery for cross-process messages: a base struct, a codec, and payload walking.

The runtime defines its own message structs (subclasses of `Message`) and a tagged union of them;
`Codec(Union[...])` turns those into msgpack bytes and back. Tensor payloads (`AnyPayload`: shared
memory, CUDA IPC, TCP, torch.distributed) nest anywhere inside (fields, `dict[str, AnyPayload]`,
lists). No pickle: a message decodes only into the declared types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import msgspec

from mstar.transport.cuda_ipc import CudaIpcPayload, release_ipc_payload
from mstar.transport.placed_channels import PAYLOAD_TYPES, AnyPayload
from mstar.transport.tensors import TensorPayload, discard_payload

M = TypeVar("M")


class Message(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    """Base for control messages: tagged by class name so a union of them decodes to the right
    class; encoded as arrays (smaller and faster than maps; every process runs the same code)."""


class Codec(Generic[M]):
    """Encodes messages of `msg_type` (a struct or a tagged union of structs) to msgpack bytes and
    decodes them back, validating against the declared types."""

    def __init__(self, msg_type: Any) -> None:
        self.msg_type = msg_type
        self._encoder = msgspec.msgpack.Encoder()
        # msgspec rejects a union of untagged structs here, with a message naming the types.
        self._decoder = msgspec.msgpack.Decoder(msg_type)

    def encode(self, msg: M) -> bytes:
        """msgpack bytes for `msg`."""
        return self._encoder.encode(msg)

    def decode(self, buf: bytes | memoryview) -> M:
        """The message in `buf`; raises msgspec.ValidationError if it is not a `msg_type`."""
        return self._decoder.decode(buf)


def iter_payloads(obj: Any) -> Iterator[AnyPayload]:
    """Every tensor payload reachable from `obj` through struct fields, dicts, lists and tuples."""
    if isinstance(obj, PAYLOAD_TYPES):
        yield obj
    elif isinstance(obj, msgspec.Struct):
        for name in obj.__struct_fields__:
            yield from iter_payloads(getattr(obj, name))
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_payloads(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from iter_payloads(value)


def discard_message(msg: Any, discard: Callable[[Any], None] | None = None) -> int:
    """Release every payload in a message that will never be consumed (a cancelled request, an
    undeliverable send) with `discard` (the process's tensor channel); by default shared-memory and
    CUDA IPC payloads are released, and the others wait for their sender's cleanup. Returns how
    many payloads were in it."""
    count = 0
    for payload in iter_payloads(msg):
        (discard or _release)(payload)
        count += 1
    return count


def _release(payload: AnyPayload) -> None:
    if isinstance(payload, TensorPayload):
        discard_payload(payload)
    elif isinstance(payload, CudaIpcPayload):
        release_ipc_payload(payload)
