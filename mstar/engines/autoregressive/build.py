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

import logging
from typing import Any

import torch

from mstar.config import CudaGraphConfig
from mstar.engines.autoregressive.engine import AutoregressiveEngine
from mstar.engines.autoregressive.sequence import Sequence
from mstar.engines.base import StepItem
from mstar.engines.kv_cache.config import KVCacheConfig, compute_num_pages
from mstar.engines.sampling import SamplingParams

logger = logging.getLogger(__name__)

CONTEXT_PORT = "prompt_ids"  # optional input port: the tokens before `input_ids` of a resumed sequence
_ENGINE_KEYS = ("eos_token_ids", "default_sampling", "max_num_seqs", "max_batch_tokens", "max_model_len",
                "enable_prefix_caching", "vocab_size")


class ResumingEngine(AutoregressiveEngine):
    """AutoregressiveEngine that resumes a sequence from `inputs["prompt_ids"]` (see the module doc).

    `vocab_size` lets a seeded sequence skip the random draws its already generated tokens consumed
    on the worker that sampled them: one row per token as wide as the logits, i.e. the model's
    `logit_width` when it has one (a window of ids, `CausalLM`), else `vocab_size`.
    """

    def __init__(self, *args: Any, vocab_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.vocab_size = vocab_size

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
        width = getattr(self.runner.model, "logit_width", None) or self.vocab_size
        if width is None:
            raise ValueError("a seeded sequence resumed on another worker needs the engine's vocab_size")
        for _ in range(count):
            torch.empty(width, dtype=torch.float32, device=self.device).exponential_(generator=generator)


def build_autoregressive_engine(built: Any, kv_config: KVCacheConfig, device: torch.device,
                                cuda_graphs: CudaGraphConfig | None = None) -> ResumingEngine:
    """The engine of an autoregressive component from its `BuiltComponent`.

    `built.engine_options` may hold: eos_token_ids, default_sampling (a SamplingParams or a dict of
    sampling options), max_num_seqs, max_batch_tokens, max_model_len, enable_prefix_caching and
    vocab_size. A `max_model_len` larger than the KV pool holds is lowered to the pool's capacity
    (logged), since one sequence must always fit in the pool.
    """
    options = dict(built.engine_options)
    unknown = sorted(set(options) - set(_ENGINE_KEYS))
    if unknown:
        raise ValueError(f"unknown autoregressive engine option(s) {unknown}; valid: {list(_ENGINE_KEYS)}")
    defaults = options.get("default_sampling")
    if isinstance(defaults, dict):
        options["default_sampling"] = SamplingParams.from_options(defaults, SamplingParams())
    if options.get("max_model_len") is not None:
        capacity = compute_num_pages(kv_config, built.module.kv_layout, device) * kv_config.page_size
        if options["max_model_len"] > capacity:
            logger.warning("max_model_len %d lowered to %d, the KV pool's capacity (raise kv_cache.max_num_pages "
                           "or memory_fraction for longer sequences)", options["max_model_len"], capacity)
            options["max_model_len"] = capacity
    return ResumingEngine(built.module, kv_config, device, cuda_graphs=cuda_graphs, **options)
