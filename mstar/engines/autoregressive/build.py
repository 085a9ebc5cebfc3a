"""Building the autoregressive engine of a component from its module and engine spec."""

from __future__ import annotations

import dataclasses
import logging

import torch

from mstar.config import CudaGraphConfig
from mstar.engines.autoregressive.engine import AutoregressiveEngine
from mstar.engines.base import AutoregressiveSpec, CausalLM
from mstar.engines.kv_cache.config import KVCacheConfig, compute_num_pages

logger = logging.getLogger(__name__)


def build_autoregressive_engine(module: CausalLM, spec: AutoregressiveSpec, kv_config: KVCacheConfig,
                                device: torch.device, cuda_graphs: CudaGraphConfig | None = None,
                                num_pages: int | None = None) -> AutoregressiveEngine:
    """The engine of an autoregressive component: `module` run as `spec` says, its KV pool `num_pages`
    pages (None: sized from `kv_config` as for a worker's only pool). A `max_model_len` larger than the
    pool holds is lowered to the pool's capacity (logged), since one sequence must always fit in it."""
    if num_pages is None:
        num_pages = compute_num_pages(kv_config, module.kv_layout, device)
    max_model_len = spec.max_model_len
    capacity = num_pages * kv_config.page_size
    if max_model_len is not None and max_model_len > capacity:
        logger.warning("max_model_len %d lowered to %d, the KV pool's capacity (raise max_num_pages or "
                       "memory_fraction for longer sequences)", max_model_len, capacity)
        max_model_len = capacity
    if cuda_graphs is not None and spec.cuda_graph_sizes is not None:
        cuda_graphs = dataclasses.replace(cuda_graphs, batch_sizes=list(spec.cuda_graph_sizes))
    return AutoregressiveEngine(module, kv_config, device, eos_token_ids=spec.eos_token_ids,
                                max_num_seqs=spec.max_num_seqs, max_batch_tokens=spec.max_batch_tokens,
                                max_model_len=max_model_len, enable_prefix_caching=spec.enable_prefix_caching,
                                cuda_graphs=cuda_graphs, num_pages=num_pages, grammars=spec.grammars,
                                kv_offer_timeout_s=spec.kv_offer_timeout_s)
