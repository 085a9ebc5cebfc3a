"""benchmarks/code2wav_bench.py: a --quick run (tiny Code2Wav on CPU) writes what it returns, with each case."""

from __future__ import annotations

import json

import pytest

from benchmarks.code2wav_bench import main

pytestmark = pytest.mark.slow  # a whole benchmark script


def test_quick_run(tmp_path) -> None:
    out = tmp_path / "c2w.json"
    doc = main(["--quick", "--batches", "1", "2", "--calls", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["build"]["pad_frames"] == 0 and doc["build"]["graph_sizes"] is None  # CPU: unpadded, no graphs
    for b in (1, 2):
        case = doc["cases"][f"b{b}"]
        assert set(case) == {"engine", "eager"}  # no graphs on the CPU
        assert abs(case["eager"]["ms_per_chunk"] - case["eager"]["wall_ms"] / b) < 1e-2
        assert case["engine"]["audio_s_per_s"] > 0
    assert [(r["frames"], r["batch"]) for r in doc["cases"]["new_width"]] == [(28, 1), (30, 1), (50, 3)]
    assert all(r["first_ms"] > 0 and r["again_ms"] > 0 for r in doc["cases"]["new_width"])
    assert doc["cases"]["stages_b1_ms"]["embed+pre_transformer"] > 0
