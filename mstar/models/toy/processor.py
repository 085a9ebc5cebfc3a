"""Toy request <-> tensors: text is UTF-8 bytes; outputs become str, numpy arrays and samples."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar.models.base import Processor


class ToyProcessor(Processor):
    """`{"text": str}` -> prompt_ids; tokens decode to characters."""

    sample_rate = 8000

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        text = request.get("text")
        if not isinstance(text, str) or not text:
            raise ValueError("toy needs a non-empty 'text' prompt")
        return {"prompt_ids": torch.tensor(list(text.encode("utf-8")), dtype=torch.long)}

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        tensor = tensor.cpu()
        if name == "text":
            return bytes(tensor.tolist()).decode("latin-1")
        return tensor.numpy()
