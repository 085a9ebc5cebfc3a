"""What every model's serving config (YAML `model_kwargs`) holds, dtype names and an LM's decode bound.

A model's config subclasses `ServeConfig` (or `LMServeConfig` for a model that tokenizes text) and adds
its own fields; engine settings (batch limits, KV pool, CUDA graph sizes) are not among them: they
are the component's engine spec (`mstar.engines.base`), set per component in the YAML `engines:`.
`checkpoint_dtype` reads a config.json's dtype; `decode_steps` bounds an LM's decode loop by max_tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_named(name: str, key: str = "dtype") -> torch.dtype:
    """The torch dtype called `name`; ValueError naming `key` and the valid names otherwise."""
    if name not in DTYPES:
        raise ValueError(f"{key}={name!r}: use one of {sorted(DTYPES)}")
    return DTYPES[name]


def checkpoint_dtype(cfg: Mapping[str, Any]) -> torch.dtype:
    """The dtype a Hugging Face config.json declares (`dtype`, or the older `torch_dtype`; bfloat16 when
    neither); ValueError for a name not in DTYPES."""
    return dtype_named(str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"), "the checkpoint's dtype")


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """The fields every model's `model_kwargs` takes."""

    tiny: bool = False  # tiny random model (and tokenizer) for tests and `--tiny`: offline, seconds
    dtype: str | None = None  # of the weights and compute; None: bfloat16 on CUDA, float32 elsewhere
    seed: int = 0  # of dummy / tiny random weights
    # Whether a tiny build with no `dtype` computes in float32 on every device, CUDA too (the tiny
    # generators' tests compare against float32 references).
    tiny_in_float32: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.dtype is not None:
            dtype_named(self.dtype, "model_kwargs.dtype")

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype to build in on `device`."""
        if self.dtype is not None:
            return DTYPES[self.dtype]
        if self.tiny and self.tiny_in_float32:
            return torch.float32
        return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass(frozen=True, kw_only=True)
class LMServeConfig(ServeConfig):
    """`ServeConfig` of a model that reads text: where its tokenizer is and how long a sequence may be."""

    tokenizer_path: str | None = None  # default: the checkpoint folder
    max_model_len: int | None = None  # tokens of prompt and output; None: the checkpoint's context


def decode_steps(context_len: int) -> Callable[[Mapping[str, Any]], int]:
    """A decode Loop's `max_iterations`: a request's max_tokens less one (its prefill samples the first
    token), or `context_len` when it sets none (the engine then ends the sequence at the context's end)."""
    def steps(options: Mapping[str, Any]) -> int:
        max_tokens = options.get("max_tokens")
        return context_len if max_tokens is None else max(int(max_tokens) - 1, 0)

    return steps


def capped_context(limit: int, asked: int | None) -> int:
    """The context a deployment serves: `max_model_len` as it asks (None: the checkpoint's `limit`); more than
    `limit` is refused, since positions past it were never trained and the setting would be cut silently."""
    if asked is not None and asked > limit:
        raise ValueError(f"max_model_len={asked} is over this checkpoint's context of {limit} tokens "
                         f"(max_position_embeddings); use at most {limit} or leave it unset")
    return asked or limit
