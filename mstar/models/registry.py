"""Lazy, string-keyed model registry: importing it imports no model."""

from __future__ import annotations

import importlib

from mstar.models.base import Model

# name -> "module:Class". Keep sorted by name.
_MODELS: dict[str, str] = {
    "llama": "mstar.models.llama.serving:DenseLM",
    "orpheus": "mstar.models.orpheus.model:OrpheusModel",
    "qwen2": "mstar.models.llama.serving:Qwen2LM",
    "qwen3": "mstar.models.llama.serving:Qwen3LM",
    "qwen3_omni": "mstar.models.qwen3_omni.model:Qwen3Omni",
    "smollm2": "mstar.models.llama.serving:SmolLM2",
    "toy": "mstar.models.toy.model:ToyModel",
    "wan22": "mstar.models.wan22.model:Wan22Model",
}


def model_names() -> list[str]:
    """Every registered model name."""
    return sorted(_MODELS)


def get_model_class(name: str) -> type[Model]:
    """The model class registered under `name`; a typo gets the list of valid names."""
    try:
        target = _MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; registered models are: {', '.join(model_names())}") from None
    module_name, cls_name = target.split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def register(name: str, target: str) -> None:
    """Register an out-of-tree model as 'package.module:Class'."""
    if ":" not in target:
        raise ValueError(f"register({name!r}, {target!r}): target must look like 'package.module:Class'")
    _MODELS[name] = target
