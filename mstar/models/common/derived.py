"""Tensors derived from a module's parameters (weights rearranged, padded or cast for a kernel), made once
and kept on the module until a parameter they come from is loaded anew or changed in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")  # a tensor, or a few of them in a dict or tuple


def derived(module: nn.Module, name: str, sources: tuple[torch.Tensor, ...], make: Callable[[], T]) -> T:
    """`make()` (run without autograd) kept on `module` under `name`, made anew when any of `sources` has new
    storage or a new in-place version."""
    key = tuple((t.data_ptr(), t._version) for t in sources)
    cache = module.__dict__.setdefault("_derived_tensors", {})
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = cache[name] = (key, make())
    return hit[1]
