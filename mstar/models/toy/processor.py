"""Toy request <-> tensors: text is UTF-8 bytes; outputs become str, numpy arrays and samples."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar.models.base import Processor


class ToyProcessor(Processor):
    """`{"text": str}` or chat `messages` -> prompt bytes; tokens decode to characters."""

    sample_rate = 8000  # of the vocoder's samples

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        text = request.get("text")
        if text is None and request.get("messages"):
            text = "\n".join(_message_text(m) for m in request["messages"])
        if not isinstance(text, str) or not text:
            raise ValueError("toy needs a non-empty text prompt")
        return {"prompt_ids": torch.tensor(list(text.encode("utf-8")), dtype=torch.long)}

    def validate_options(self, options: Mapping[str, Any]) -> None:
        max_tokens = options.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if max_tokens > 1 << 20:
            raise ValueError(f"max_tokens={max_tokens} is above the toy's limit of {1 << 20}")

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        tensor = tensor.cpu()
        if name == "text":
            return bytes(tensor.tolist()).decode("latin-1")
        return tensor.numpy()


def _message_text(message: Mapping[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, str):
        return content
    return " ".join(part.get("text", "") for part in content if part.get("type") == "text")
