"""Throwaway prompts run through an autoregressive engine before its worker reports ready, so that the
first requests pay for no kernel compilation and no per-shape GEMM timing (on by default on CUDA)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mstar.engines.base import LoopSpec, StepItem

if TYPE_CHECKING:
    from mstar.engines.autoregressive.engine import AutoregressiveEngine


def warm_up_engine(engine: AutoregressiveEngine, alone: tuple[int, ...] = (5, 12, 24, 48),
                   together: tuple[int, ...] = (5, 16, 33)) -> None:
    """Prefill and two decode steps of throwaway prompts through the engine's real path. Each of `alone` is
    prefilled by itself (5 / 12 / 24 / 48 rows hit the row buckets 8 / 16 / 32 / 64 that `layers/linear.py`
    decides per shape), then `together` as one batch (batched prefill and decode), greedy and once more
    sampled (temperature, top-p, repetition penalty: the sampling kernels compile and the sampling graphs are
    captured here, not in the first sampled request; unseeded, since seeded rows never take the graphs).
    Every prompt repeats its own token, so none reuses another's cached prefix (which would shrink its
    prefill)."""
    greedy = {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}
    sampled = {**greedy, "temperature": 1.0, "top_p": 0.9, "repetition_penalty": 1.1}
    runs = [([n], greedy) for n in alone] + [(list(together), greedy), (list(together), sampled)]
    token = 0
    for lengths, options in runs:
        prompts = []
        for n in lengths:
            token += 1
            if n + 3 < engine.max_model_len:
                prompts.append((f"__warmup_{token}", torch.full((n,), token, dtype=torch.long)))
        for rid, ids in prompts:  # each one engine loop: the prompt, then decode steps as served
            engine.submit(StepItem(rid, "warmup", "warmup", {"input_ids": ids}, options, loop=LoopSpec(3)))
        while engine.has_work():
            for r in engine.step():
                if r.error is not None:
                    raise RuntimeError(f"engine warm-up failed: {r.error}")
        for rid, _ in prompts:
            engine.release(rid)
