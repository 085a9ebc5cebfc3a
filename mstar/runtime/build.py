"""Building a model and the engines of one worker; shared by thread and process workers."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from mstar.config import ConfigError, MStarConfig
from mstar.engines.base import Engine
from mstar.models.base import BuiltComponent, Model
from mstar.models.registry import get_model_class

logger = logging.getLogger(__name__)


def build_model(config: MStarConfig, tiny: bool = False, load_format: str = "auto",
                model_path: str | None = None) -> Model:
    """The registered model of `config.model`, configured from model_kwargs."""
    cls = get_model_class(config.model)
    valid = sorted(f.name for f in dataclasses.fields(cls.make_config(tiny=tiny)))
    unknown = sorted(set(config.model_kwargs) - set(valid))
    if unknown:
        raise ConfigError(f"{config.source}: unknown key 'model_kwargs.{unknown[0]}' for model {config.model!r}; "
                          f"valid keys here are {valid}")
    model_cfg = cls.make_config(tiny=tiny, **config.model_kwargs)
    return cls(model_cfg, load_format=load_format, model_path=model_path)


def worker_device(config: MStarConfig, rank: int) -> torch.device:
    """cuda:<rank> when CUDA is available (or asked for), else cpu."""
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))


def build_engines(model: Model, config: MStarConfig, components: list[str], device: torch.device,
                  shards: dict[str, Any] | None = None) -> dict[str, Engine]:
    """One engine per component placed on this worker; a component in `shards` (a tensor-parallel one)
    is built as this rank's share of it (`layers.parallel.tensor_parallel`).

    Every component's weights go on the device before any engine is made: an autoregressive engine
    sizes its KV pool from the memory free when it is made, so weights built after a pool might not
    fit (Qwen3-Omni on one GPU: the talker's pool took 60% of the GPU before the 57 GiB thinker).
    """
    graph = model.graph()
    built = {}
    from mstar.layers.parallel import tensor_parallel

    shards = shards or {}
    for name in components:
        with tensor_parallel(shards.get(name)):
            built[name] = model.build_component(name, device)
        logger.info("built component %s on %s%s", name, device,
                    f" (share {shards[name].index + 1} of {shards[name].size})" if name in shards else "")
    engines: dict[str, Engine] = {}
    for name in components:
        kind = graph.components[name].engine
        engines[name] = _engine(kind, built.pop(name), config, device)
        logger.info("made the %s engine of %s", kind, name)
    return engines


def _engine(kind: str, built: Any, config: MStarConfig, device: torch.device) -> Engine:
    options = dict(built.engine_options)
    own_stream = options.pop("own_stream", False)  # engines/own_stream.py

    def make() -> Engine:
        if kind == "stateless":
            from mstar.engines.stateless import StatelessEngine

            return StatelessEngine(built.module, **options)
        from mstar.engines.autoregressive import build_autoregressive_engine

        return build_autoregressive_engine(BuiltComponent(built.module, options), config.kv_cache, device,
                                           config.cuda_graphs)

    if not own_stream:
        return make()
    from mstar.engines.own_stream import on_own_stream

    return on_own_stream(make, device)
