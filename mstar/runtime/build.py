"""Building a model and the engines of one worker; shared by thread and process workers."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from mstar.config import ConfigError, MStarConfig, typed_values
from mstar.engines.base import SPEC_OF_ENGINE, AutoregressiveSpec, Engine, StatelessSpec, tunable
from mstar.graph import ModelGraph
from mstar.models.base import BuiltComponent, Model
from mstar.models.registry import get_model_class

logger = logging.getLogger(__name__)


def build_model(config: MStarConfig, tiny: bool = False, load_format: str = "auto",
                model_path: str | None = None) -> Model:
    """The registered model of `config.model`, configured from model_kwargs, with the deployment's
    per-component engine settings (`engines:`) checked against its graph."""
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format {load_format!r}: use 'auto' or 'dummy' (random weights)")
    cls = get_model_class(config.model)
    valid = sorted(f.name for f in dataclasses.fields(cls.make_config(tiny=tiny)))
    unknown = sorted(set(config.model_kwargs) - set(valid))
    if unknown:
        raise ConfigError(f"{config.source}: unknown key 'model_kwargs.{unknown[0]}' for model {config.model!r}; "
                          f"valid keys here are {valid}")
    model_cfg = cls.make_config(tiny=tiny, **config.model_kwargs)
    model = cls(model_cfg, load_format=load_format, model_path=model_path)
    model.engine_settings = engine_settings(config, model.graph())
    model.quantization = quantization(config, model)
    return model


def quantization(config: MStarConfig, model: Model) -> dict[str, str]:
    """component -> its quantization (`quantization:`); ConfigError naming the file for an unknown
    component, one that cannot be quantized, or an unknown method."""
    from mstar.layers.fp8 import METHODS

    components = model.graph().components
    for component, method in config.quantization.items():
        if component not in components:
            raise ConfigError(f"{config.source}: unknown key 'quantization.{component}': model {config.model!r} "
                              f"has no such component; valid keys here are {sorted(components)}")
        if component not in model.quantizable:
            raise ConfigError(f"{config.source}: quantization.{component}: component {component!r} of model "
                              f"{config.model!r} cannot be quantized; quantizable: {list(model.quantizable) or 'none'}")
        if method not in METHODS:
            raise ConfigError(f"{config.source}: quantization.{component}={method!r}: use one of {sorted(METHODS)}")
    return dict(config.quantization)


def engine_settings(config: MStarConfig, graph: ModelGraph) -> dict[str, dict[str, Any]]:
    """component -> the `engines:` values the deployment sets for it, typed; ConfigError naming the file
    and the valid keys for an unknown component or key, or a bad value."""
    out = {}
    for component, values in config.engines.items():
        spec = graph.components.get(component)
        if spec is None:
            raise ConfigError(f"{config.source}: unknown key 'engines.{component}': model {config.model!r} has no "
                              f"such component; valid keys here are {sorted(graph.components)}")
        kind = SPEC_OF_ENGINE[spec.engine]
        typed = typed_values(kind, values, config.source, f"engines.{component}.", tunable(kind))
        try:
            kind(**typed)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{config.source}: engines.{component}: {exc}") from None
        out[component] = typed
    return out


def worker_device(config: MStarConfig, rank: int) -> torch.device:
    """cuda:<rank> when CUDA is available (or asked for), else cpu."""
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (nothing for a CPU one): CUDA graph captures,
    streams, events and Triton launches that name no device take the current one, which would otherwise be
    cuda:0 for every worker of a host."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def build_engines(model: Model, config: MStarConfig, components: list[str], device: torch.device,
                  shards: dict[str, Any] | None = None) -> dict[str, Engine]:
    """One engine per component placed on this worker; a component in `shards` (a tensor-parallel one)
    is built as this rank's share of it (`layers.parallel.tensor_parallel`).

    Every component's weights go on the device before any engine is made; the stateless engines (and
    their CUDA graphs) come next, and the KV pools of the autoregressive ones are then sized together from
    the memory free (`kv_pool_pages`), so neither the build order nor one engine's graphs decide another's
    pool.
    """
    graph = model.graph()
    built: dict[str, BuiltComponent] = {}
    from mstar.layers.parallel import tensor_parallel

    shards = shards or {}
    for name in components:
        with tensor_parallel(shards.get(name)):
            component = model.build_component(name, device)
        kind = SPEC_OF_ENGINE[graph.components[name].engine]
        if not isinstance(component.engine, kind):
            raise TypeError(f"{type(model).__name__}.build_component({name!r}) returned a "
                            f"{type(component.engine).__name__}; its {graph.components[name].engine} engine takes "
                            f"{kind.__name__}")
        # the deployment's settings win, also where the model's build did not read them
        built[name] = dataclasses.replace(component, engine=dataclasses.replace(
            component.engine, **model.engine_settings.get(name, {})))
        logger.info("built component %s on %s%s", name, device,
                    f" (share {shards[name].index + 1} of {shards[name].size})" if name in shards else "")
    from mstar.engines.kv_cache.config import kv_pool_pages

    # stateless engines first: the CUDA graphs they capture hold memory the KV pools must leave free
    stateless = [n for n in components if isinstance(built[n].engine, StatelessSpec)]
    made = {name: _engine(built.pop(name), config, device, None) for name in stateless}
    pools = {n: (b.module.kv_layout, b.engine) for n, b in built.items() if isinstance(b.engine, AutoregressiveSpec)}
    pages = kv_pool_pages(pools, config.kv_cache, device)
    for name in built:
        if name in shards and name in pages:
            _check_same_kv_pool(name, pages[name], shards[name])
        made[name] = _engine(built[name], config, device, pages.get(name), tensor_parallel=name in shards)
    for name in components:
        logger.info("made the %s engine of %s", graph.components[name].engine, name)
    return {name: made[name] for name in components}


def context_lens(engines: dict[str, Engine]) -> dict[str, int]:
    """Each autoregressive engine's `max_model_len` by component: the limit it enforces, lowered to what its
    KV pool holds, which the server's processor then quotes (`Processor.limit_context`)."""
    from mstar.engines.autoregressive.engine import AutoregressiveEngine
    from mstar.engines.own_stream import OwnStreamEngine

    lens = {}
    for name, engine in engines.items():
        inner = engine.engine if isinstance(engine, OwnStreamEngine) else engine
        if isinstance(inner, AutoregressiveEngine):
            lens[name] = inner.max_model_len
    return lens


def _check_same_kv_pool(component: str, pages: int, shard: Any) -> None:
    """The ranks of a tensor-parallel engine must hold KV pools of one size: the batch schedulers admit
    and preempt by free pages, and two sizes would part them. A pool sized from free memory differs per
    rank when the ranks hold other components; the error says how to fix it."""
    counts = [None] * shard.size
    torch.distributed.all_gather_object(counts, pages, group=shard.group)
    if len(set(counts)) > 1:
        raise ValueError(f"tensor-parallel component {component!r}: its ranks sized their KV pools at {counts} "
                         f"pages; set engines.{component}.max_num_pages (or kv_cache.max_num_pages) so that every "
                         "rank holds the same")


def _engine(built: BuiltComponent, config: MStarConfig, device: torch.device, pages: int | None,
            tensor_parallel: bool = False) -> Engine:
    spec = built.engine
    if isinstance(spec, StatelessSpec):
        from mstar.engines.stateless import StatelessEngine

        return StatelessEngine(built.module, spec, config.cuda_graphs)
    assert pages is not None

    def make() -> Engine:
        from mstar.engines.autoregressive import build_autoregressive_engine

        engine = build_autoregressive_engine(built.module, spec, config.kv_cache, device, config.cuda_graphs, pages)
        # the ranks of a tensor-parallel replica must draw the same tokens (worker/replica.py)
        engine.seed_per_request = tensor_parallel
        return engine

    if not spec.own_stream:
        return make()
    from mstar.engines.own_stream import on_own_stream

    return on_own_stream(make, device)
