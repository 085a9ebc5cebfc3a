"""Config dataclasses read from a Hugging Face config.json section: each field from its key, with the
dataclass's own default where the section lacks the key, and the RoPE base wherever transformers put it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def from_hf_fields(cls: type[T], cfg: Mapping[str, Any], keys: Mapping[str, str] | None = None, **values: Any) -> T:
    """`cls` (a dataclass) with each field read from `cfg` under the key `keys` names for it (its own name
    otherwise), cast to the type of the field's default (int, float, bool or tuple). A key `cfg` lacks, or holds
    null for, leaves the default; for a field without one it raises KeyError naming the key. `values` set fields
    outright: those computed from several keys."""
    keys = keys or {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in values or not f.init:
            continue
        key = keys.get(f.name, f.name)
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if cfg.get(key) is not None:
            value = cfg[key]
            values[f.name] = type(default)(value) if isinstance(default, int | float | bool | tuple) else value
        elif default is dataclasses.MISSING:
            raise KeyError(f"config key {key!r} ({cls.__name__}.{f.name}) is missing")
    return cls(**values)


def rope_theta(cfg: Mapping[str, Any], what: str, default: float = 10000.0) -> float:
    """The RoPE base of `cfg`: inside `rope_parameters` (transformers >= 5), else `rope_scaling`'s or the top
    level's `rope_theta`. ValueError naming `what` for a RoPE other than the default (unscaled) one."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{what} rope {rope!r} is not supported; only the default RoPE is")
    return float(rope.get("rope_theta", cfg.get("rope_theta", default)))
