"""Memory-checked placement: what each device will hold, counted before any weight is loaded.

Each component placed on a device is built on the meta device (shapes, no storage) to count its weight
bytes in the dtype and quantization the deployment asks for; an autoregressive component adds the KV
pool its config asks for (a page count, or, for a pool sized from a share of the memory left, one step's
tokens), a stateless one the pool its spec declares (`StatelessSpec.kv_pool`: BAGEL's contexts) and, where
graphs are captured, the buffers its graphs write (`StatelessSpec.graph_buffers`: V-JEPA 2-AC's caches); every
component adds an allowance for activations and CUDA-graph pools, and every device one for
the CUDA context. A placement that cannot fit is refused at start with one line that names the device,
each component's need and what would fit (`MemoryPlanError`). Off CUDA nothing is checked.
docs/operations.md, "GPU memory", tabulates every shipped config on an 80 GB and a 141 GB card
(`describe`, kept current by tests/unit/test_memory_plan.py).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mstar.config import SHIPPED_CONFIGS, ConfigError, MStarConfig, load_config
from mstar.engines.base import AutoregressiveSpec
from mstar.engines.kv_cache.config import asked_pages, page_bytes
from mstar.graph.placement import PlacementPlan, plan_placement
from mstar.layers.attention import HeadShard
from mstar.models.base import BuiltComponent, Model
from mstar.models.common.serve_config import DTYPES, ServeConfig

logger = logging.getLogger(__name__)
GiB = 1 << 30
# Estimates, not measurements: the CUDA context and library workspaces outside PyTorch's allocator, per device
CUDA_CONTEXT_BYTES = 1 * GiB
# activations of one step and the CUDA-graph pools of an engine, by engine kind, but no more than its weights
# and SMALL_ALLOWANCE_BYTES, since a small component's activations are small too (a stateless component
# without weights, such as a scheduler, gets none)
AUTOREGRESSIVE_ALLOWANCE_BYTES = 2 * GiB
STATELESS_ALLOWANCE_BYTES = 1 * GiB
SMALL_ALLOWANCE_BYTES = 256 << 20
# total_memory of the cards the shipped configs are chosen for (NVML's 81559 MiB and 143771 MiB)
CARDS = {"80 GB (H100)": 85_520_809_984, "141 GB (H200)": 150_754_820_096}


class MemoryPlanError(ConfigError):
    """A placement does not fit its devices; the one-line message says what would."""


@dataclass(frozen=True)
class ComponentNeed:
    """The bytes one component takes on its device."""

    name: str
    weight_bytes: int
    kv_bytes: int  # the pool asked for, or the floor of one sized from a memory share (`kv_share`)
    kv_share: bool  # the pool takes a share of what is left: `kv_bytes` is its floor, one step's tokens
    kv_page_bytes: int  # one page of its pool (0: no pool)
    allowance_bytes: int  # activations and CUDA-graph pools, estimated
    kv_setting: str = ""  # where a stateless component's pool (`StatelessSpec.kv_pool`) is sized; "": none
    buffer_bytes: int = 0  # buffers its captured graphs write (`StatelessSpec.graph_buffers`)
    buffer_setting: str = ""  # where those are sized; "": none

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.buffer_bytes + self.allowance_bytes

    def describe(self) -> str:
        kv = f" + {_gib(self.kv_bytes)} KV{' (at least)' if self.kv_share else ''}" if self.kv_bytes else ""
        buffers = f" + {_gib(self.buffer_bytes)} graph caches" if self.buffer_bytes else ""
        return (f"{self.name} {_gib(self.weight_bytes)} weights{kv}{buffers} + {_gib(self.allowance_bytes)} "
                "activations")


@dataclass(frozen=True)
class DevicePlan:
    """What one device will hold: the components of every worker rank placed on it."""

    device: int  # CUDA index
    total_bytes: int
    needs: tuple[ComponentNeed, ...]

    @property
    def need_bytes(self) -> int:
        return CUDA_CONTEXT_BYTES + sum(n.total for n in self.needs)

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.total_bytes

    def describe(self) -> str:
        parts = "; ".join(n.describe() for n in self.needs if n.total)
        return (f"cuda:{self.device} ({_gib(self.total_bytes)}) needs {_gib(self.need_bytes)}: {parts}; "
                f"CUDA context {_gib(CUDA_CONTEXT_BYTES)}")


def cuda_devices() -> list[int]:
    """total_memory of each visible CUDA device, in index order; empty without CUDA. The seam tests replace."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]


def check_memory(config: MStarConfig, tiny: bool = False, model_path: str | None = None) -> list[DevicePlan]:
    """The plan of every device `config` uses; MemoryPlanError naming what would fit when one overflows.
    Nothing is checked (an empty list) off CUDA."""
    devices = cuda_devices()
    plans = _plan_if_sized(config, devices, tiny, model_path) if config.device != "cpu" and devices else None
    if plans is None:
        return []
    over = [p for p in plans if not p.fits]
    if over:
        raise MemoryPlanError(f"{config.source} does not fit: {over[0].describe()}. "
                              f"{_what_fits(config, over[0], devices, tiny, model_path)}")
    return plans


def plan_memory(config: MStarConfig, devices: list[int], tiny: bool = False,
                model_path: str | None = None) -> list[DevicePlan]:
    """What each CUDA device of `devices` (total bytes by index) holds when worker rank r runs on device
    r % len(devices), as `runtime.build.worker_device` places it."""
    model = _meta_model(config, tiny, model_path)
    plan = plan_placement(model.graph(), config.node_groups, config.source)
    built: dict[tuple[str, HeadShard | None], BuiltComponent] = {}
    needs: dict[int, list[ComponentNeed]] = {}
    for rank in range(plan.num_workers):
        seen: set[int] = set()  # tensors shared by two components of one worker count once
        for name in plan.components_on(rank):
            shard = _shard(plan, model, rank, name)
            if (name, shard) not in built:
                built[(name, shard)] = _build_on_meta(model, name, shard)
            needs.setdefault(rank % len(devices), []).append(
                _need(model, config, name, built[(name, shard)], seen))
    return [DevicePlan(i, devices[i], tuple(needs[i])) for i in sorted(needs)]


def fitting_config(candidates: list[MStarConfig], tiny: bool = False, model_path: str | None = None
                   ) -> MStarConfig:
    """The first of `candidates` whose placement fits the visible CUDA devices; the first one when none
    fits (its refusal then names what would) or there is no CUDA."""
    devices = cuda_devices()
    for config in candidates if devices and len(candidates) > 1 else ():
        plans = _plan_if_sized(config, devices, tiny, model_path)
        if plans is not None and all(p.fits for p in plans):
            if config is not candidates[0]:
                logger.info("using %s: %s does not fit the GPU memory", config.source, candidates[0].source)
            return config
    return candidates[0]


def _plan_if_sized(config: MStarConfig, devices: list[int], tiny: bool, model_path: str | None
                   ) -> list[DevicePlan] | None:
    """`plan_memory`, or None (logged) for a model that cannot be sized: one that takes no random weights or
    whose build needs values a meta tensor lacks (an out-of-tree model, say); its start is then unchecked."""
    try:
        return plan_memory(config, devices, tiny, model_path)
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        logger.warning("GPU memory not checked: %s cannot be sized on the meta device (%s: %s)", config.source,
                       type(exc).__name__, exc)
        return None


def memory_variants(model: str) -> list[str]:
    """The shipped variants of `<model>.yaml` for smaller cards, `<model>_<N>gb.yaml`, by falling N:
    what `mstar serve <model>` tries next when `<model>.yaml` does not fit."""
    sizes = {p.stem: re.fullmatch(rf"{re.escape(model)}_(\d+)gb", p.stem) for p in SHIPPED_CONFIGS.glob("*.yaml")}
    return sorted((name for name, m in sizes.items() if m), key=lambda name: -int(sizes[name].group(1)))


def describe() -> str:
    """The markdown tables of docs/operations.md, "GPU memory": each shipped config's estimated need per
    GPU and whether it fits each card of CARDS, then what `mstar serve <model>` takes on one such card."""
    from mstar.config import config_from_dict, shipped_configs
    from mstar.models.registry import model_names

    head = " | ".join(CARDS)
    lines = [f"| Config | GPUs | Estimated need per GPU | {head} |", "| --- | --- | --- |" + " --- |" * len(CARDS)]
    for name in shipped_configs():
        config = load_config(name)
        needs = _needs(config, config.num_workers)
        if isinstance(needs, str):
            lines.append(f"| {name} | {config.num_workers} | {needs} |" + " - |" * len(CARDS))
            continue
        fits = " | ".join("fits" if max(needs) <= total else "refused" for total in CARDS.values())
        lines.append(f"| {name} | {config.num_workers} | {' + '.join(map(_gib, needs))} | {fits} |")
    lines += ["", f"| `mstar serve <model>` on one GPU | {head} |", "| --- |" + " --- |" * len(CARDS)]
    for model in model_names():
        names = ([model] if model in shipped_configs() else []) + memory_variants(model)
        configs = [load_config(n) for n in names] or [config_from_dict({"model": model})]
        needs = [_needs(c, 1) for c in configs]
        if isinstance(needs[0], str):
            lines.append(f"| {model} |" + f" {needs[0]} |" * len(CARDS))
            continue
        names = names or ["no config: defaults"]
        picks = [next((n for n, need in zip(names, needs, strict=True) if need[0] <= total),
                      f"refused ({_gib(needs[0][0])})") for total in CARDS.values()]
        lines.append(f"| {model} | {' | '.join(picks)} |")
    return "\n".join(lines) + "\n"


def _needs(config: MStarConfig, gpus: int) -> list[int] | str:
    """The bytes each of `gpus` GPUs needs, or why the model cannot be sized without a checkpoint."""
    try:
        return [p.need_bytes for p in plan_memory(config, [0] * gpus)]
    except ValueError as exc:  # a model sized by its checkpoint (--model-path) has no default shapes
        return str(exc).split(":")[0]


def _meta_model(config: MStarConfig, tiny: bool, model_path: str | None) -> Model:
    """The model with random weights (no checkpoint is read) in the dtype it takes on CUDA."""
    from mstar.runtime.build import build_model

    model = build_model(config, tiny=tiny, load_format="dummy", model_path=model_path)
    if isinstance(model.config, ServeConfig) and model.config.dtype is None:
        dtype = model.config.torch_dtype(torch.device("cuda"))
        name = next(k for k, v in DTYPES.items() if v == dtype)
        model = build_model(dataclasses.replace(config, model_kwargs={**config.model_kwargs, "dtype": name}),
                            tiny=tiny, load_format="dummy", model_path=model_path)
    return model


def _shard(plan: PlacementPlan, model: Model, rank: int, name: str) -> HeadShard | None:
    """The share of tensor-parallel component `name` that `rank` builds (None: all of it)."""
    from mstar.runtime.replicas import multi_rank_replicas

    if not model.graph().components[name].tensor_parallel:
        return None
    replica = next((r for r in multi_rank_replicas(plan).get(name, ()) if rank in r), None)
    return None if replica is None else HeadShard(replica.index(rank), len(replica), None)


def _build_on_meta(model: Model, name: str, shard: HeadShard | None) -> BuiltComponent:
    from mstar.layers.parallel import tensor_parallel

    with tensor_parallel(shard):
        return model.build_component(name, torch.device("meta"))


def _need(model: Model, config: MStarConfig, name: str, built: BuiltComponent, seen: set[int]) -> ComponentNeed:
    """`name`'s bytes: its tensors not in `seen` (which it then joins), its KV pool and its allowance."""
    module = built.module
    tensors = [*module.parameters(), *module.buffers()] if isinstance(module, nn.Module) else []
    weights = sum(t.numel() * t.element_size() for t in tensors if id(t) not in seen)
    seen.update(id(t) for t in tensors)
    spec = dataclasses.replace(built.engine, **model.engine_settings.get(name, {}))
    if not isinstance(spec, AutoregressiveSpec):
        allowance = min(STATELESS_ALLOWANCE_BYTES, weights + SMALL_ALLOWANCE_BYTES) if weights else 0
        buffers = spec.graph_buffers if config.cuda_graphs.enabled else None  # allocated when graphs are captured
        extra = {"buffer_bytes": buffers.nbytes, "buffer_setting": buffers.setting} if buffers else {}
        pool = spec.kv_pool  # a pool the component keeps its own contexts in: the page count it declares
        if pool is None:
            return ComponentNeed(name, weights, 0, False, 0, allowance, **extra)
        return ComponentNeed(name, weights, pool.nbytes(), False, pool.page_bytes(), allowance, pool.setting, **extra)
    per_page = page_bytes(module.kv_layout, config.kv_cache.page_size)
    pages = asked_pages(spec, config.kv_cache)
    share = pages is None  # sized from a share of what is left, its context following: at least one step's tokens
    if share:
        pages = -(-min(spec.max_batch_tokens, spec.max_model_len or spec.max_batch_tokens) // config.kv_cache.page_size)
    return ComponentNeed(name, weights, pages * per_page, share, per_page,
                         min(AUTOREGRESSIVE_ALLOWANCE_BYTES, weights + SMALL_ALLOWANCE_BYTES))


def _what_fits(config: MStarConfig, over: DevicePlan, devices: list[int], tiny: bool, model_path: str | None) -> str:
    """One sentence of the changes that would fit: fewer KV pages, another shipped config, FP8 weights."""
    ideas = []
    fixed = [n for n in over.needs if n.kv_page_bytes and not n.kv_share and not n.kv_setting]
    room = over.total_bytes - over.need_bytes + sum(n.kv_bytes for n in fixed)
    pages = room // sum(n.kv_page_bytes for n in fixed) if fixed else 0
    if pages >= 1:
        own = any("max_num_pages" in config.engines.get(n.name, {}) for n in fixed)
        where = "kv_cache" if config.kv_cache.max_num_pages and not own else f"engines.{'/'.join(n.name for n in fixed)}"
        ideas.append(f"{where}.max_num_pages: {pages}")
    ideas += [f"a smaller {n.kv_setting} (its pool takes {_gib(n.kv_bytes)})" for n in over.needs if n.kv_setting]
    ideas += [f"a smaller {n.buffer_setting} (its graphs' caches take {_gib(n.buffer_bytes)}), or cuda_graphs.enabled: "
              "false" for n in over.needs if n.buffer_bytes]
    for name in _shipped_of(config.model):
        other = load_config(name)
        if Path(other.source).resolve() == Path(config.source).resolve():
            continue
        gpus = other.num_workers
        if all(p.fits for p in plan_memory(other, [over.total_bytes] * gpus, tiny, model_path)):
            ideas.append(f"--config {name}" + (f" on {gpus} GPUs of this size" if gpus > 1 else ""))
    if _fp8_fits(config, over, devices, tiny, model_path):
        ideas.append("--quantization fp8")
    return ("What would fit: " + "; or ".join(ideas) + ".") if ideas else \
        "No shipped config of this model fits a device of this size; use a larger GPU or more of them."


def _fp8_fits(config: MStarConfig, over: DevicePlan, devices: list[int], tiny: bool, model_path: str | None) -> bool:
    """Whether FP8 weights for the model's quantizable components on `over` that are not yet would fit."""
    from mstar.models.registry import get_model_class

    names = {n.name for n in over.needs}
    todo = [c for c in get_model_class(config.model).quantizable if c in names and c not in config.quantization]
    if not todo:
        return False
    quantized = dataclasses.replace(config, quantization={**config.quantization, **dict.fromkeys(todo, "fp8")})
    return next(p for p in plan_memory(quantized, devices, tiny, model_path) if p.device == over.device).fits


def _shipped_of(model: str) -> list[str]:
    """Names of the shipped configs serving `model`."""
    import yaml

    return [p.stem for p in sorted(SHIPPED_CONFIGS.glob("*.yaml"))
            if (yaml.safe_load(p.read_text()) or {}).get("model") == model]


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"
