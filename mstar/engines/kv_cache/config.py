"""KV cache configuration (the `kv_cache` YAML section) and the page-pool sizing rule."""

from __future__ import annotations

import logging

import torch

from mstar.config import KVCacheConfig
from mstar.engines.base import KVLayout

__all__ = ["CPU_DEFAULT_POOL_BYTES", "KVCacheConfig", "compute_num_pages", "page_bytes"]

logger = logging.getLogger(__name__)

# Without a device to measure, the CPU pool gets a fixed, modest budget: CPU runs are tests and
# offline trials, and sizing from host RAM would grab memory other processes need.
CPU_DEFAULT_POOL_BYTES = 256 * 1024 * 1024


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
