"""benchmarks/vjepa2_bench.py: a --quick run (tiny networks on CPU) writes what it returns, its cached
rollouts equal the recompute loop's, the world model's lanes (eager on CPU) give the eager results, and
--profile lists the top ops of a plan forward at each frame position."""

from __future__ import annotations

import json

import pytest

from benchmarks.vjepa2_bench import main

# a whole benchmark script: the slow group (tests/conftest.py: one_thread)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_quick_run(tmp_path) -> None:
    out = tmp_path / "vjepa2.json"
    doc = main(["--quick", "--repeats", "1", "--profile", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["device"] == "cpu" and doc["dtype"] == "float32"
    for horizon in (2, 4):
        case = doc["rollout"][f"h{horizon}"]
        assert case["graphs"]["ms"] > 0 and case["kv_cache"]["ms"] > 0 and case["recompute"]["ms"] > 0
        assert case["max_abs_diff"] < 1e-4  # the two loops compute the same latents
        assert case["graphs_vs_eager_max_abs_diff"] < 1e-5
    assert set(doc["encoder_clips"]) == {"b1", "b2"} and doc["encoder_clips"]["b2"]["clips_per_s"] > 0
    plan = doc["plan"]
    assert plan["graphs"]["s_per_action"] > 0 and plan["eager"]["s_per_action"] > 0
    assert plan["graphs_vs_eager_max_abs_diff"] < 1e-5 and plan["settings"]["samples"] == 16
    profile = doc["profile"]
    assert profile["samples"] == 16 and profile["block_gemm_tflop"] > 0
    for position in (0, 1):  # the default horizon of 2
        ops = profile[f"position{position}"]
        assert 0 < len(ops["top"]) <= 25 and ops["total_us"] > 0 and ops["gemm_tflop_per_s"] > 0
        assert any("linear" in op["name"] or "addmm" in op["name"] for op in ops["top"])
