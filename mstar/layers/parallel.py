"""Which share of a tensor-parallel component is being built: set by the runtime around a component's
build (`tensor_parallel(shard)`), read by the model's builder (`current_tensor_parallel()`), so the
builders of models without tensor parallelism never see it and `Model.build_component` keeps its
signature. None: the whole component."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

from mstar.layers.attention import HeadShard

_SHARD: contextvars.ContextVar[HeadShard | None] = contextvars.ContextVar("mstar_tensor_parallel", default=None)


@contextmanager
def tensor_parallel(shard: HeadShard | None) -> Iterator[None]:
    """Components built inside are `shard`'s share (rank `shard.index` of `shard.size`, over `shard.group`)."""
    token = _SHARD.set(shard)
    try:
        yield
    finally:
        _SHARD.reset(token)


def current_tensor_parallel() -> HeadShard | None:
    """The share being built now; None outside `tensor_parallel` (the whole component)."""
    return _SHARD.get()
