"""Whose scratch memory a kernel launch uses.

Kernels that keep memory between launches (split-K workspaces and per-tile counters: `gemv.py`,
`skinny_gemm.py`) cache one buffer per device and size, allocated at the first launch and baked into
every CUDA graph captured after it. Launches on one stream use such a buffer one after another, so
sharing it is safe there. An engine stepped on a CUDA stream of its own (`engines/own_stream.py`) runs
its kernels beside those of the worker's stream: two launches of one size on the two streams would
add up each other's partial sums and count each other's tiles (a tile summed before its partials are
in, a counter left off zero for every later launch of that size).

So everything such an engine builds, captures and steps runs inside `scratch_owner(its stream)`, and
the caches key their buffers by `current_owner()` too: its launches get buffers of their own. The
owner is per thread (each in-process worker is a thread); None, the default, is the worker's stream.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_LOCAL = threading.local()


@contextmanager
def scratch_owner(owner: Any) -> Iterator[None]:
    """Kernel launches inside the block use scratch buffers of `owner` (hashable; a CUDA stream)."""
    before = getattr(_LOCAL, "owner", None)
    _LOCAL.owner = owner
    try:
        yield
    finally:
        _LOCAL.owner = before


def current_owner() -> Any:
    """The owner whose scratch buffers launches use now (None: the shared ones)."""
    return getattr(_LOCAL, "owner", None)
