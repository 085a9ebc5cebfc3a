"""Building a module at full size without allocating it twice."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def build_on_meta(factory: Callable[[], nn.Module], dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """`factory()` built on the meta device with `dtype` as the default dtype, then materialised on
    `device` with UNINITIALISED weights and buffers (load or fill them next; recompute derived buffers),
    in eval mode: no full-size float32 copy is ever allocated."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            module = factory()
    finally:
        torch.set_default_dtype(previous)
    return module.to_empty(device=device).eval()
