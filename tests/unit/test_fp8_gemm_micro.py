"""benchmarks/fp8_gemm_micro.py: its shapes are Wan2.2's DiT linears, its --quick run executes every FP8 form
on CPU (Triton interpreter) with the forms agreeing, and `step_ms` sums a step's linears."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.interpreted import run_interpreted

pytest.importorskip("triton")

from benchmarks.fp8_gemm_micro import WAN_BLOCK, WAN_BLOCKS, step_ms  # noqa: E402
from mstar.models.wan22.config import WanTransformerConfig  # noqa: E402
from mstar.models.wan22.transformer import WanBlock  # noqa: E402

ROOT = Path(__file__).parents[2]


def test_shapes_are_a_wan_blocks_linears():
    config = WanTransformerConfig()
    assert WAN_BLOCKS == config.num_layers
    with torch.device("meta"):  # shapes only
        block = WanBlock(config)
    shapes: dict[tuple[int, int], int] = {}
    for module in block.modules():
        if isinstance(module, torch.nn.Linear) and module is not block.attn2.to_kv:  # to_kv: text, once a request
            key = (module.out_features, module.in_features)
            shapes[key] = shapes.get(key, 0) + 1
    assert shapes == {(n, k): calls for n, k, calls, _ in WAN_BLOCK.values()}


def test_step_ms_sums_a_blocks_calls_over_the_blocks():
    rows = [{"shape": name, "a_us": 10.0 * (i + 1)} for i, name in enumerate(WAN_BLOCK)]
    calls = [WAN_BLOCK[name][2] for name in WAN_BLOCK]
    want = WAN_BLOCKS * sum(10.0 * (i + 1) * c for i, c in enumerate(calls)) / 1e3
    assert step_ms(rows) == {"a": round(want, 2)}
    rows[0]["b_us"] = 1.0  # a form that failed on the other shapes has no step total
    assert step_ms(rows) == {"a": round(want, 2)}


@pytest.mark.slow  # runs the whole benchmark script under the Triton interpreter
def test_quick_run_executes_every_form(tmp_path):
    out = tmp_path / "micro.json"
    proc = run_interpreted(ROOT / "benchmarks" / "fp8_gemm_micro.py", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == list(WAN_BLOCK)
    for r in rows:
        assert r["fp8_max_err"] == r["fp8_formula_max_err"]  # the kernel quantizes to the formula's bits
        assert max(r[f"{f}_max_err"] for f in ("fp8", "fp8_bias", "fp8_bias_fast")) < 0.02
