"""benchmarks/vjepa2_bench.py: a --quick run (tiny networks on CPU) writes what it returns, its cached
rollouts equal the recompute loop's, the world model's lanes (eager on CPU) give the eager results, and
--profile lists the top ops of a plan forward at each frame position; --quick --rotary (under the Triton
interpreter) times the rotary's PyTorch form and kernel at each shape."""

from __future__ import annotations

import json

import pytest

from benchmarks.vjepa2_bench import ROOT, main
from tests.interpreted import run_interpreted

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


def test_quick_rotary(tmp_path) -> None:
    out = tmp_path / "rotary.json"
    proc = run_interpreted(ROOT / "benchmarks" / "vjepa2_bench.py", "--quick", "--rotary", "--samples", "2",
                           "--repeats", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["dtype"] == "float32"
    rotary = doc["rotary"]
    assert rotary.pop("pdl") is False
    assert set(rotary) == {"plan_q", "plan_k", "rollout_q", "rollout_k", "encoder_q"}
    assert rotary["plan_k"]["shape"] == [2, 3, 18, 16] and rotary["rollout_q"]["shape"] == [1, 3, 18, 16]
    assert rotary["encoder_q"]["shape"] == [1, 4, 32, 16]  # the tiny encoder: 4 heads, 2 x 4 x 4 tubelets
    for name, row in rotary.items():
        assert row["mb_moved"] > 0 and row["loops"] == 1, name
        assert set(row) == {"shape", "mb_moved", "loops", "torch", "kernel"}, name
        for form in ("torch", "kernel"):
            assert row[form]["us"] > 0 and row[form]["gb_per_s"] > 0, (name, form)
        assert row["kernel"]["mismatch"] == 0, name  # its timed call wrote what its reference call did
        # torch's CPU addcmul rounds once (an FMA) where the kernel rounds twice: some float32 elements differ
        # by a rounding, where a wrong pairing or layout would differ nearly everywhere
        assert row["torch"]["mismatch"] < 0.5, name


def test_quick_run_bf16_then_fp8(tmp_path) -> None:
    """--quantization none fp8: the first setting at the top level with the recompute loop, the FP8 predictor's
    cases under settings.fp8 without it, and its rollout latents against the first setting's (different: the
    quantization ran)."""
    doc = main(["--quick", "--repeats", "1", "--horizons", "2", "--quantization", "none", "fp8",
                "--out", str(tmp_path / "fp8.json")])
    assert doc["quantization"] == "none" and doc["rollout"]["h2"]["recompute"]["ms"] > 0
    fp8 = doc["settings"]["fp8"]
    assert set(fp8["rollout"]["h2"]) == {"graphs", "kv_cache", "graphs_vs_eager_max_abs_diff"}
    assert fp8["plan"]["graphs"]["s_per_action"] > 0 and fp8["plan"]["graphs_vs_eager_max_abs_diff"] < 1e-5
    assert 0 < fp8["latents_vs_first"]["rel_rms"] < 1 and fp8["latents_vs_first"]["max_abs"] > 0
    with pytest.raises(SystemExit):
        main(["--quick", "--quantization", "fp8", "fp8"])
