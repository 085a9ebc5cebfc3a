"""KV cache configuration (the `kv_cache` YAML section) and the page-pool sizing rule."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

import torch

from mstar.engines.base import KVLayout

logger = logging.getLogger(__name__)

# Without a device to measure, the CPU pool gets a fixed, modest budget: CPU runs are tests and
# offline trials, and sizing from host RAM would grab memory other processes need.
CPU_DEFAULT_POOL_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class KVCacheConfig:
    """How large the paged KV pool is and which attention backend reads it.

    Pool size: `max_num_pages` when given; otherwise, on CUDA, `memory_fraction` of the device
    memory still free once the weights are loaded; on CPU, `CPU_DEFAULT_POOL_BYTES` (256 MiB).
    """

    max_num_pages: int | None = None  # explicit page count; wins over memory_fraction
    page_size: int = 16  # tokens per page
    memory_fraction: float = 0.9  # share of free device memory (after weights) given to the pool (GPU)
    cpu_offload_pages: int = 0  # reserved: host pages for offloading (not implemented yet)
    attention_backend: str = "auto"  # "auto" or "sdpa" for now

    def __post_init__(self) -> None:
        if self.max_num_pages is not None and (not _is_int(self.max_num_pages) or self.max_num_pages < 1):
            raise ValueError(f"kv_cache.max_num_pages={self.max_num_pages!r}: use a positive integer or omit it")
        if not _is_int(self.page_size) or self.page_size < 1:
            raise ValueError(f"kv_cache.page_size={self.page_size!r}: use a positive integer such as 16")
        if not isinstance(self.memory_fraction, int | float) or not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"kv_cache.memory_fraction={self.memory_fraction!r}: use a number in (0, 1]")
        if not _is_int(self.cpu_offload_pages) or self.cpu_offload_pages < 0:
            raise ValueError(f"kv_cache.cpu_offload_pages={self.cpu_offload_pages!r}: use an integer >= 0")
        if not isinstance(self.attention_backend, str) or not self.attention_backend:
            raise ValueError(f"kv_cache.attention_backend={self.attention_backend!r}: use a name such as 'auto'")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVCacheConfig:
        """Build from a parsed YAML mapping; an unknown key is an error naming the valid ones."""
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ValueError(f"unknown kv_cache key(s) {unknown}; valid keys: {sorted(valid)}")
        return cls(**data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def page_bytes(layout: KVLayout, page_size: int) -> int:
    """Bytes one page takes across all layers, K and V together."""
    itemsize = torch.empty((), dtype=layout.dtype).element_size()
    return 2 * layout.num_layers * page_size * layout.num_kv_heads * layout.head_dim * itemsize


def compute_num_pages(config: KVCacheConfig, layout: KVLayout, device: torch.device | str) -> int:
    """Number of pages for the pool: explicit `max_num_pages`, else sized from memory (see KVCacheConfig).

    Call it after the model's weights are on `device`, so that free memory excludes them.
    """
    if config.max_num_pages is not None:
        return config.max_num_pages
    device = torch.device(device)
    per_page = page_bytes(layout, config.page_size)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * config.memory_fraction)
        source = f"{config.memory_fraction} of {free / 2**30:.2f} GiB free on {device}"
    else:
        budget = CPU_DEFAULT_POOL_BYTES
        source = f"the {CPU_DEFAULT_POOL_BYTES // 2**20} MiB default for {device.type}"
    num_pages = budget // per_page
    if num_pages < 1:
        raise ValueError(
            f"no room for a single KV page ({per_page} bytes) in {source}; "
            "set kv_cache.max_num_pages or free device memory"
        )
    logger.info("KV pool: %d pages of %d tokens (%.1f MiB) from %s",
                num_pages, config.page_size, num_pages * per_page / 2**20, source)
    return num_pages
