"""How tensors ride in messages: by reference in one process, as payloads across processes."""

from __future__ import annotations

from typing import Any

import torch


class LocalCodec:
    """In-process mode: tensors travel as themselves (GPU tensors stay on their device)."""

    def pack(self, value: Any) -> Any:
        return value

    def unpack(self, value: Any) -> Any:
        return value

    def discard(self, value: Any) -> None:
        pass


class PayloadCodec:
    """Across processes: host tensors inline or through shared memory (transport.ShmTensorChannel)."""

    def __init__(self, session: str) -> None:
        from mstar.transport.tensor_channels import ShmTensorChannel

        self.channel = ShmTensorChannel(session)

    def pack(self, value: torch.Tensor) -> Any:
        return self.channel.pack(value.detach().cpu() if value.device.type != "cpu" else value, "")

    def unpack(self, value: Any) -> torch.Tensor:
        return self.channel.unpack(value)

    def discard(self, value: Any) -> None:
        self.channel.discard(value)
