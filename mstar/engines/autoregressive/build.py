"""Building the autoregressive engine of a component, and resuming sequences started elsewhere.

Prefill/decode split: the KV cache of a request lives in the engine of the worker that ran its
prefill, so a decode walk placed on another worker meets a sequence its engine has never seen.
A model makes that case correct without changing its graph by also feeding the decode node the
request's prompt on the port `prompt_ids`: `ResumingEngine` starts an unknown sequence from
`prompt_ids + input_ids` (recomputing the prompt's KV once) and counts `input_ids` as tokens
already generated, so penalties, `min_tokens`, `max_tokens` and seeded sampling continue exactly
where the prefill worker left off. For a sequence it already holds, `prompt_ids` is ignored.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from mstar.config import CudaGraphConfig
from mstar.engines.autoregressive.engine import AutoregressiveEngine
from mstar.engines.autoregressive.sequence import Sequence
from mstar.engines.base import AutoregressiveSpec, CausalLM, StepItem
from mstar.engines.kv_cache.config import KVCacheConfig, compute_num_pages
from mstar.engines.sampling import SamplingParams

logger = logging.getLogger(__name__)

CONTEXT_PORT = "prompt_ids"  # optional input port: the tokens before `input_ids` of a resumed sequence


class ResumingEngine(AutoregressiveEngine):
    """AutoregressiveEngine that resumes a sequence from `inputs["prompt_ids"]` (see the module doc).

    A seeded sequence resumed here skips the random draws its already generated tokens consumed on the
    worker that sampled them: one row as wide as the logits (`CausalLM.logit_width`) per token.
    """

    def _new_sequence(self, key: tuple[str, str], item: StepItem, tokens: list[int]) -> Sequence:
        context = item.inputs.get(CONTEXT_PORT)
        if context is None:
            return super()._new_sequence(key, item, tokens)
        prompt = context.tolist()
        params = SamplingParams.from_options(item.options, self.default_sampling)
        total = len(prompt) + len(tokens)
        budget = len(prompt) + (params.max_tokens or 0)
        if total >= self.max_model_len or budget > self.max_model_len:
            raise ValueError(f"resumed sequence of {len(prompt)} prompt + {len(tokens)} generated tokens "
                             f"(max_tokens={params.max_tokens}) does not fit max_model_len={self.max_model_len}")
        seq = super()._new_sequence(key, item, prompt + tokens)
        seq.num_prompt, seq.num_generated = len(prompt), len(tokens)
        if seq.generator is not None:
            self._skip_draws(seq.generator, len(tokens))
        logger.debug("resumed %s from a %d-token prompt and %d generated tokens", key, len(prompt), len(tokens))
        return seq

    def _skip_draws(self, generator: torch.Generator, count: int) -> None:
        # sampling draws one Exp(1) row as wide as the logits per token (engines/sampling.py)
        width = self.runner.model.logit_width
        for _ in range(count):
            torch.empty(width, dtype=torch.float32, device=self.device).exponential_(generator=generator)


def build_autoregressive_engine(module: CausalLM, spec: AutoregressiveSpec, kv_config: KVCacheConfig,
                                device: torch.device, cuda_graphs: CudaGraphConfig | None = None,
                                num_pages: int | None = None) -> ResumingEngine:
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
    return ResumingEngine(module, kv_config, device, eos_token_ids=spec.eos_token_ids,
                          max_num_seqs=spec.max_num_seqs, max_batch_tokens=spec.max_batch_tokens,
                          max_model_len=max_model_len, enable_prefix_caching=spec.enable_prefix_caching,
                          cuda_graphs=cuda_graphs, num_pages=num_pages)
