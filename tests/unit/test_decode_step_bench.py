"""benchmarks/decode_step.py: a --quick run (tiny Llama on CPU) measures bf16 and FP8 in one run and writes
what it returns, each FP8 row against the bf16 floor and bf16's step at its batch."""

from __future__ import annotations

import json

import pytest

from benchmarks.decode_step import main

pytestmark = pytest.mark.slow  # a whole benchmark script


def test_quick_run_with_bf16_and_fp8(tmp_path) -> None:
    out = tmp_path / "decode_step.json"
    doc = main(["--quick", "--batch-sizes", "1", "2", "--quantization", "none", "fp8", "fp8_head", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert [(r["quantization"], r["batch"]) for r in doc["rows"]] == [
        ("none", 1), ("none", 2), ("fp8", 1), ("fp8", 2), ("fp8_head", 1), ("fp8_head", 2)]
    bf16, fp8, head = doc["variants"]["none"], doc["variants"]["fp8"], doc["variants"]["fp8_head"]
    assert fp8["bf16_floor_ms"] == head["bf16_floor_ms"] == bf16["bf16_floor_ms"] == bf16["floor_ms"] == doc["floor_ms"]
    assert head["weight_bytes"] < fp8["weight_bytes"]  # the head at 1 byte, the untied embedding not read whole
    assert fp8["weight_bytes"] < 0.7 * bf16["weight_bytes"] and fp8["floor_ms"] < bf16["floor_ms"]  # decoder linears at 1 byte
    assert fp8["timed_choices"] == [] and "timed_choices" not in bf16  # the CPU times no kernel choice
    steps = {(r["quantization"], r["batch"]): r["mstar_ms_per_step"] for r in doc["rows"]}
    for row in doc["rows"]:
        assert row["mstar_ms_per_step"] > 0 and row["floor_ms"] == doc["floor_ms"]
        assert row["over_bf16_floor"] == pytest.approx(row["mstar_ms_per_step"] / doc["floor_ms"], rel=2e-3)
        if row["quantization"] != "none":
            want = steps[row["quantization"], row["batch"]] / steps["none", row["batch"]]
            assert row["over_bf16_step"] == pytest.approx(want, rel=2e-3)
        else:
            assert "over_bf16_step" not in row
