"""One typed config tree, built once from YAML (keys compatible with the original M* configs).

Unknown keys and impossible values are errors that name the key and the file.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

SHIPPED_CONFIGS = Path(__file__).parent / "configs"  # one YAML per shipped placement, package data


class ConfigError(ValueError):
    """A config file or value is wrong; the message names the key and the file."""


@dataclass(frozen=True)
class KVCacheConfig:
    """How large the paged KV pool is and which attention backend reads it.

    Pool size: `max_num_pages` when given; otherwise, on CUDA, `memory_fraction` of the device
    memory still free once the weights are loaded; on CPU, `CPU_DEFAULT_POOL_BYTES` (256 MiB).
    """

    max_num_pages: int | None = None  # explicit page count; wins over memory_fraction
    page_size: int = 16  # tokens per page
    memory_fraction: float = 0.9  # share of free device memory (after weights) given to the pool (GPU)
    # "auto": on CUDA triton when it imports and initialises, else flashinfer, else sdpa;
    # or "sdpa" (reference, CPU and GPU), "triton" or "flashinfer" (CUDA, float16/bfloat16)
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.max_num_pages is not None and (not _is_int(self.max_num_pages) or self.max_num_pages < 1):
            raise ValueError(f"kv_cache.max_num_pages={self.max_num_pages!r}: use a positive integer or omit it")
        if not _is_int(self.page_size) or self.page_size < 1:
            raise ValueError(f"kv_cache.page_size={self.page_size!r}: use a positive integer such as 16")
        if not isinstance(self.memory_fraction, int | float) or not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"kv_cache.memory_fraction={self.memory_fraction!r}: use a number in (0, 1]")
        if not isinstance(self.attention_backend, str) or not self.attention_backend:
            raise ValueError(f"kv_cache.attention_backend={self.attention_backend!r}: use a name such as 'auto'")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class LimitsConfig:
    """What one request may bring (the `limits` YAML section); docs/operations.md gives the memory each
    default allows. Every limit is checked before the input is decoded or tokenized."""

    max_body_bytes: int = 64 * 1024 * 1024  # a request body; room for inline media
    body_timeout_s: float = 10.0  # longest wait for the next piece of a body, then 408
    max_media_bytes: int = 50 * 1024 * 1024  # one media input, encoded (inline or fetched)
    max_image_pixels: int = 64 * 1024 * 1024  # width x height, from the header
    max_audio_seconds: float = 3600.0
    max_audio_samples: int = 16_000 * 3600  # decoded frames x channels: an hour of 16 kHz mono, 230 MB
    max_video_pixels: int = 256 * 1280 * 720  # decoded frames x width x height, 708 MB as RGB
    # route path -> its own values of the media keys, e.g. {"/v1/audio/transcriptions": {"max_audio_seconds": 7200}}
    routes: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "routes" and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
                raise ValueError(f"{f.name}={value!r}: use a positive number")
        for route, values in self.routes.items():
            unknown = set(values) - set(ROUTE_LIMITS) if isinstance(values, dict) else {"(not a mapping)"}
            if not route.startswith("/") or unknown:
                raise ValueError(f"routes[{route!r}]: give a route path and a mapping of {', '.join(ROUTE_LIMITS)} "
                                 f"(got {values!r})")
            self.for_route(route)  # its values are checked as the whole section's are

    def for_route(self, route: str) -> LimitsConfig:
        """These limits with `route`'s own values applied."""
        values = self.routes.get(route)
        return dataclasses.replace(self, routes={}, **values) if values else self


ROUTE_LIMITS = ("max_media_bytes", "max_image_pixels", "max_audio_seconds", "max_audio_samples", "max_video_pixels")


@dataclass(frozen=True)
class CudaGraphConfig:
    """CUDA graphs for decode steps and captured components (the `cuda_graphs` YAML section).

    Only used on CUDA devices. Graphs are captured during warm-up (before the server reports ready)
    at each size of `batch_sizes` (default: 1, 2, 4, 8, then steps of 8 up to `max_batch_size`); a
    batch runs in the smallest captured size that holds it, padded, and larger batches run eagerly.
    """

    enabled: bool = True
    max_batch_size: int = 64
    batch_sizes: list[int] | None = None
    lookahead: bool = True  # launch decode step N+1 before reading step N's tokens (engines/autoregressive/lookahead.py)
    sampling: bool = True  # replay sampling from CUDA graphs too (engines/sampling_graph.py)
    # with lookahead and sampling graphs: a steady step's draw and the next forward in one graph replay
    # (engines/autoregressive/step_graph.py)
    step_graphs: bool = True
    # token buckets at which steps with prompt tokens replay graphs (engines/autoregressive/prefill_graph.py);
    # empty (the default): such steps run eagerly; each bucket holds a whole-model graph, so configs pick
    # buckets per model (mstar/configs/orpheus.yaml)
    prefill_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not _is_int(self.max_batch_size) or self.max_batch_size < 1:
            raise ValueError(f"cuda_graphs.max_batch_size={self.max_batch_size!r}: use a positive integer")
        if not isinstance(self.prefill_tokens, list) or any(not _is_int(t) or t < 1 for t in self.prefill_tokens):
            raise ValueError(f"cuda_graphs.prefill_tokens={self.prefill_tokens!r}: use a list of positive "
                             "integers such as [16, 32, 64, 128, 256], or [] for none")
        if self.batch_sizes is not None and (not self.batch_sizes or any(
                not _is_int(b) or b < 1 for b in self.batch_sizes)):
            raise ValueError(f"cuda_graphs.batch_sizes={self.batch_sizes!r}: use a list of positive integers")

    def sizes(self) -> list[int]:
        """The batch sizes to capture, ascending."""
        if self.batch_sizes is not None:
            return sorted(set(self.batch_sizes))
        small = [b for b in (1, 2, 4) if b < self.max_batch_size]
        return small + list(range(8, self.max_batch_size, 8)) + [self.max_batch_size]


@dataclass
class NodeGroup:
    """`node_groups[]` — one placement: components, for which walks, on which worker ranks."""

    node_names: list[str]  # components placed here
    ranks: list[int]  # worker ranks; with tp_size * sp_size == 1 each rank is one replica
    graph_walks: list[str] | None = None  # only these walks run here (None: all walks)
    tp_size: int = 1  # tensor-parallel degree of one replica
    sp_size: int = 1  # sequence-parallel (Ulysses) degree of one replica

    def validate(self, where: str) -> None:
        if not self.node_names:
            raise ConfigError(f"{where}: node_names is empty")
        if not self.ranks or any(r < 0 for r in self.ranks):
            raise ConfigError(f"{where}: ranks must be a non-empty list of ranks >= 0, got {self.ranks}")
        if len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(f"{where}: ranks {self.ranks} repeat a rank")
        size = self.tp_size * self.sp_size
        if self.tp_size < 1 or self.sp_size < 1 or len(self.ranks) % size:
            raise ConfigError(
                f"{where}: {len(self.ranks)} ranks cannot be split into replicas of tp_size*sp_size={size}"
            )

    def replicas(self) -> list[tuple[int, ...]]:
        """The ranks of each replica, in order."""
        size = self.tp_size * self.sp_size
        return [tuple(self.ranks[i : i + size]) for i in range(0, len(self.ranks), size)]


RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class RayWorkers:
    """`ray.workers[]` — where Ray places some worker ranks (`mstar serve --ray-address`): each rank gets
    one placement-group bundle of `num_cpus`, `num_gpus` and `resources`, on the node `node_ip` names."""

    ranks: list[int]  # the worker ranks this entry places
    node_ip: str | None = None  # the Ray node (its IP address) they run on; None: wherever the bundle fits
    resources: dict[str, float] = field(default_factory=dict)  # Ray resources each rank asks for, e.g. {node_b: 1}
    num_cpus: float = 1.0
    num_gpus: float | None = None  # None: 1 unless the config's device is cpu or the cluster has no GPU

    def validate(self, where: str, num_workers: int) -> None:
        if not self.ranks or any(not _is_int(r) or not 0 <= r < num_workers for r in self.ranks):
            raise ConfigError(f"{where}: ranks must name worker ranks 0..{num_workers - 1}, got {self.ranks}")
        amounts = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus or 0.0, **self.resources}
        bad = {k: v for k, v in amounts.items() if isinstance(v, bool) or not isinstance(v, int | float) or v < 0}
        if bad:
            raise ConfigError(f"{where}: resource amounts must be numbers >= 0, got {bad}")


@dataclass
class RayConfig:
    """`ray` — how `mstar serve --ray-address` places workers on a Ray cluster; ignored without Ray."""

    workers: list[RayWorkers] = field(default_factory=list)  # ranks not listed get the default bundle
    strategy: str = "PACK"  # the placement group's strategy: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD

    def validate(self, where: str, num_workers: int) -> None:
        if self.strategy not in RAY_STRATEGIES:
            raise ConfigError(f"{where}: ray.strategy {self.strategy!r} must be one of {RAY_STRATEGIES}")
        seen: set[int] = set()
        for i, entry in enumerate(self.workers):
            entry.validate(f"{where}: ray.workers[{i}]", num_workers)
            if seen & set(entry.ranks):
                raise ConfigError(f"{where}: ray.workers[{i}] places rank {min(seen & set(entry.ranks))} again")
            seen |= set(entry.ranks)

    def bundle_of(self, rank: int) -> RayWorkers:
        """The entry that places `rank` (a default one when none lists it)."""
        return next((e for e in self.workers if rank in e.ranks), RayWorkers(ranks=[rank]))


@dataclass
class MStarConfig:
    """The whole deployment: which model, its placement, and runtime limits."""

    model: str  # registry name, e.g. "toy", "smollm2"
    node_groups: list[NodeGroup] = field(default_factory=list)  # empty: every component on rank 0
    max_concurrent_requests: int = 64  # requests in flight at once; more wait in the queue
    max_queued_requests: int = 1024  # a full queue rejects new requests instead of growing
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    cuda_graphs: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    model_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the model's config
    # component -> its engine settings (mstar.engines.base: AutoregressiveSpec, StatelessSpec), over the
    # model's defaults; keys checked against the model's graph when it is built (runtime.build.engine_settings)
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    # component -> weight quantization ("fp8": E4M3 with per-channel scales, "fp8_block": 128x128 block
    # scales); checked against the model's quantizable components when it is built (runtime.build)
    quantization: dict[str, str] = field(default_factory=dict)
    device: str = "auto"  # "auto" (cuda:<rank> when CUDA is there, else cpu) | "cpu" | "cuda"
    ray: RayConfig = field(default_factory=RayConfig)  # worker placement on a Ray cluster (--ray-address)
    source: str = "<dict>"  # where this config came from, for error messages

    def validate(self) -> None:
        where = self.source
        if self.max_concurrent_requests < 1:
            raise ConfigError(f"{where}: max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}")
        if self.max_queued_requests < 0:
            raise ConfigError(f"{where}: max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"{where}: device {self.device!r} must be auto, cpu or cuda")
        for i, group in enumerate(self.node_groups):
            group.validate(f"{where}: node_groups[{i}]")
        self.ray.validate(where, self.num_workers)
        if not isinstance(self.model_kwargs, dict):
            raise ConfigError(f"{where}: model_kwargs must be a mapping, got {self.model_kwargs!r}")
        if not isinstance(self.quantization, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.quantization.items()):
            raise ConfigError(f"{where}: quantization must map components to a method, e.g. "
                              f"{{llm: fp8}}; got {self.quantization!r}")

    @property
    def num_workers(self) -> int:
        return 1 + max((r for g in self.node_groups for r in g.ranks), default=0)


def shipped_configs() -> list[str]:
    """Names of the configs that ship inside the package (`mstar/configs/<name>.yaml`)."""
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml"))


def config_file(path_or_name: str | Path) -> Path:
    """The YAML file that a `--config` value means: a path, or the name of a shipped config
    (`toy_3workers` or `toy_3workers.yaml`), so every config works from any directory."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    shipped = SHIPPED_CONFIGS / f"{path.stem}.yaml"
    if path.parent == Path(".") and path.suffix in ("", ".yaml") and shipped.is_file():
        return shipped
    raise ConfigError(f"config file {path} does not exist (shipped configs, usable by name: "
                      f"{', '.join(shipped_configs())})")


def load_config(path: str | Path, **overrides: Any) -> MStarConfig:
    """Read a YAML file (a path or a shipped config's name) into a validated MStarConfig;
    `overrides` replace top-level keys."""
    import yaml

    path = config_file(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    data.update({k: v for k, v in overrides.items() if v is not None})
    return config_from_dict(data, source=str(path))


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> MStarConfig:
    """Build and validate a config from plain data (as parsed from YAML)."""
    data = dict(data)
    data.pop("source", None)
    if "max_seq_len" in data:  # an M* key that mstar would otherwise accept and ignore
        raise ConfigError(f"{source}: max_seq_len is not taken: each model bounds its own context; set "
                          "model_kwargs.max_model_len (mstar serve --max-model-len) instead")
    if isinstance(data.get("kv_cache"), dict) and "cpu_offload_pages" in data["kv_cache"]:  # an M* key, likewise
        raise ConfigError(f"{source}: kv_cache.cpu_offload_pages is not taken: mstar does not offload KV pages to "
                          "the host; remove the key")
    cfg = _build(MStarConfig, data, source, "")
    cfg.source = source
    cfg.validate()
    return cfg


def _build(cls: type, data: Any, source: str, prefix: str) -> Any:
    kwargs = typed_values(cls, data, source, prefix, [f.name for f in dataclasses.fields(cls) if f.name != "source"])
    for f in dataclasses.fields(cls):
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{source}: {prefix.rstrip('.') or 'the config'} needs key {f.name!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        # a section's own message names its key with or without the section; name the section once
        text = str(exc)
        raise ConfigError(f"{source}: {text if text.startswith(prefix) else prefix + text}") from None


def typed_values(cls: type, data: Any, source: str, prefix: str, valid: typing.Sequence[str]) -> dict[str, Any]:
    """`data` (a mapping of some of the dataclass `cls`'s fields) with each value checked against, and
    coerced to, its field's type; ConfigError naming the file, the key and the `valid` keys otherwise."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ConfigError(f"{source}: unknown key '{prefix}{unknown[0]}'; valid keys here are {sorted(valid)}")
    hints = typing.get_type_hints(cls)
    return {name: _coerce(hints[name], value, source, f"{prefix}{name}") for name, value in data.items()}


def _coerce(hint: Any, value: Any, source: str, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        return _coerce(hint, value, source, key)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, source, f"{key}.")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key} must be a list, got {value!r}")
        return [_coerce(args[0], v, source, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(hint, type) and (not isinstance(value, hint) or (hint is int and isinstance(value, bool))):
        raise ConfigError(f"{source}: {key} must be {hint.__name__}, got {value!r}")
    return value
