"""Lazy, string-keyed model registry: importing it imports no model.

Names map to "module:Class" strings, imported only by `get_model_class`, which also takes the
`mstar.models` entry points of installed packages and "package.module:Class" names; `register` adds an
out-of-tree model by name.
"""

from __future__ import annotations

import importlib

from mstar.models.base import Model

# name -> "module:Class". Keep sorted by name.
_MODELS: dict[str, str] = {
    "bagel": "mstar.models.bagel.model:BagelModel",
    "cosmos3": "mstar.models.cosmos3.model:Cosmos3Model",
    "cosmos3_droid": "mstar.models.cosmos3.model:Cosmos3DroidModel",
    "llama": "mstar.models.llama.serving:DenseLM",
    "orpheus": "mstar.models.orpheus.model:OrpheusModel",
    "pi05": "mstar.models.pi05.model:Pi05",
    "qwen2": "mstar.models.llama.serving:Qwen2LM",
    "qwen3": "mstar.models.llama.serving:Qwen3LM",
    "qwen3_omni": "mstar.models.qwen3_omni.model:Qwen3Omni",
    "smollm2": "mstar.models.llama.serving:SmolLM2",
    "toy": "mstar.models.toy.model:ToyModel",
    "vjepa2": "mstar.models.vjepa2.model:VJEPA2",
    "vjepa2_ac": "mstar.models.vjepa2.model:VJEPA2AC",
    "wan22": "mstar.models.wan22.model:Wan22Model",
}


ENTRY_POINT_GROUP = "mstar.models"  # installed packages may add models under this group: name = "module:Class"


def model_names() -> list[str]:
    """Every registered model name, those of installed packages' entry points included."""
    return sorted(set(_MODELS) | {ep.name for ep in _entry_points()})


def get_model_class(name: str) -> type[Model]:
    """The model class registered under `name`, an installed package's entry point of that name, or the
    class a 'package.module:Class' name points at; a typo gets the list of valid names."""
    target = _MODELS.get(name) or next((ep.value for ep in _entry_points() if ep.name == name), None)
    if target is None and ":" in name:
        target = name
    if target is None:
        raise KeyError(f"unknown model {name!r}; registered models are: {', '.join(model_names())} "
                       "(or name an out-of-tree one as 'package.module:Class')")
    module_name, _, cls_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as exc:
        raise KeyError(f"model {name!r}: cannot load {target!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Model)):
        raise KeyError(f"model {name!r}: {target!r} is not a subclass of mstar.models.base.Model")
    return cls


def _entry_points():
    from importlib.metadata import entry_points

    return entry_points(group=ENTRY_POINT_GROUP)


def register(name: str, target: str) -> None:
    """Register an out-of-tree model as 'package.module:Class'."""
    if ":" not in target:
        raise ValueError(f"register({name!r}, {target!r}): target must look like 'package.module:Class'")
    _MODELS[name] = target
