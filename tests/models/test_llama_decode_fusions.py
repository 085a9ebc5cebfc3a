"""A tiny Llama decodes the same greedy tokens through TritonBackend (interpreted on CPU) with every
decode fusion on as with none, and the fused paths really run (see llama_fusion_parity.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")


def test_greedy_tokens_same_with_fusions_on_and_off():
    proc = run_interpreted(Path(__file__).with_name("llama_fusion_parity.py"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for dtype, r in results.items():
        assert r["on"] == r["off"], (dtype, r)
        assert all(len(t) == 3 for t in r["on"]), r
        # 2 layers x 2 norms x 2 decode steps folded into GEMVs; 2 layers x 2 steps rotated in attention.
        assert r["fused_norm_calls"] == [0, 8], r
        assert r["rotary_in_attention_calls"] == [0, 4], r
        tol = 1e-5 if dtype == "torch.float32" else 3e-2
        assert r["logit_err"] <= tol * max(1.0, r["logit_scale"]), r
