"""KV cache configuration (the `kv_cache` YAML section) and the page-pool sizing rule."""

from __future__ import annotations

import logging

import torch

from mstar.config import KVCacheConfig
from mstar.engines.base import AutoregressiveSpec, KVLayout

__all__ = ["CPU_DEFAULT_POOL_BYTES", "KVCacheConfig", "asked_pages", "compute_num_pages", "kv_pool_pages",
           "page_bytes"]

logger = logging.getLogger(__name__)

# Without a device to measure, the CPU pool gets a fixed, modest budget: CPU runs are tests and
# offline trials, and sizing from host RAM would grab memory other processes need.
CPU_DEFAULT_POOL_BYTES = 256 * 1024 * 1024


def page_bytes(layout: KVLayout, page_size: int) -> int:
    """Bytes one page takes across all layers, K and V together."""
    itemsize = torch.empty((), dtype=layout.dtype).element_size()
    return 2 * layout.num_layers * page_size * layout.num_kv_heads * layout.head_dim * itemsize


def asked_pages(spec: AutoregressiveSpec, config: KVCacheConfig) -> int | None:
    """The page count a component's pool is given outright, or None when it is sized from a share of the
    memory free (`kv_pool_pages` says in which order the settings win)."""
    if spec.max_num_pages is not None or spec.memory_fraction is not None:
        return spec.max_num_pages
    return config.max_num_pages


def compute_num_pages(config: KVCacheConfig, layout: KVLayout, device: torch.device | str) -> int:
    """Pages of the pool of a worker's only autoregressive component (`kv_pool_pages` for one pool): explicit
    `max_num_pages`, else sized from memory (see KVCacheConfig). Call it once the weights are on `device`."""
    return kv_pool_pages({"kv": (layout, AutoregressiveSpec())}, config, device)["kv"]


def kv_pool_pages(pools: dict[str, tuple[KVLayout, AutoregressiveSpec]], config: KVCacheConfig,
                  device: torch.device | str) -> dict[str, int]:
    """component -> pages of its KV pool, for the autoregressive components of one worker, sized together
    once their weights are on `device` (whatever order their engines are made in).

    A component's own `max_num_pages` wins, then its own `memory_fraction` (of the memory free now); the
    others take `kv_cache.max_num_pages`, or split what is left of `kv_cache.memory_fraction` in
    proportion to their page sizes, so each holds as many tokens. Off CUDA every pool gets
    `CPU_DEFAULT_POOL_BYTES` unless a page count is given.
    """
    device = torch.device(device)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" and pools else 0
    pages: dict[str, int] = {}
    shared: dict[str, int] = {}  # component -> bytes per page, for the pools that split the rest
    claimed = 0.0
    for name, (layout, spec) in pools.items():
        per_page = page_bytes(layout, config.page_size)
        if asked_pages(spec, config) is not None:
            pages[name] = asked_pages(spec, config)
        elif spec.memory_fraction is not None and device.type == "cuda":
            pages[name] = _fit(name, int(free * spec.memory_fraction) // per_page, per_page,
                               f"engines.{name}.memory_fraction={spec.memory_fraction} of {free / 2**30:.2f} GiB free")
            claimed += spec.memory_fraction
        elif config.max_num_pages is not None:  # off CUDA a component's memory_fraction has nothing to share
            pages[name] = config.max_num_pages
        elif device.type != "cuda":
            pages[name] = _fit(name, CPU_DEFAULT_POOL_BYTES // per_page, per_page,
                               f"the {CPU_DEFAULT_POOL_BYTES // 2**20} MiB default for {device.type}")
        else:
            shared[name] = per_page
    if shared:
        rest = config.memory_fraction - claimed
        if rest <= 0:
            raise ValueError(f"the engines' memory_fraction values add up to {claimed:g}, leaving nothing of "
                             f"kv_cache.memory_fraction={config.memory_fraction} for {sorted(shared)}; give those a "
                             "memory_fraction too, or raise kv_cache.memory_fraction")
        # equal page counts: each pool gets the same share of `rest` per byte of its page
        count = int(free * rest) // sum(shared.values())
        for name, per_page in shared.items():
            pages[name] = _fit(name, count, per_page, f"{rest:g} of {free / 2**30:.2f} GiB free on {device}"
                               + (f", shared by {len(shared)} pools" if len(shared) > 1 else ""))
    for name, (layout, _spec) in pools.items():
        logger.info("KV pool of %s: %d pages of %d tokens (%.1f MiB)", name, pages[name], config.page_size,
                    pages[name] * page_bytes(layout, config.page_size) / 2**20)
    return pages


def _fit(name: str, num_pages: int, per_page: int, source: str) -> int:
    if num_pages < 1:
        raise ValueError(f"no room for a single KV page of {name} ({per_page} bytes) in {source}; set "
                         f"engines.{name}.max_num_pages (or kv_cache.max_num_pages) or free device memory")
    return num_pages
