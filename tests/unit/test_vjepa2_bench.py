"""benchmarks/vjepa2_bench.py: a --quick run (tiny networks on CPU) writes what it returns, and its cached
rollouts equal the recompute loop's."""

from __future__ import annotations

import json

import pytest

from benchmarks.vjepa2_bench import main

# a whole benchmark script: the slow group (tests/conftest.py: one_thread)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_quick_run(tmp_path) -> None:
    out = tmp_path / "vjepa2.json"
    doc = main(["--quick", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["device"] == "cpu" and doc["dtype"] == "float32"
    for horizon in (2, 4):
        case = doc["rollout"][f"h{horizon}"]
        assert case["kv_cache"]["ms"] > 0 and case["recompute"]["ms"] > 0
        assert case["max_abs_diff"] < 1e-4  # the two loops compute the same latents
    assert set(doc["encoder_clips"]) == {"b1", "b2"} and doc["encoder_clips"]["b2"]["clips_per_s"] > 0
    assert doc["plan"]["s_per_action"] > 0 and doc["plan"]["settings"]["samples"] == 16
