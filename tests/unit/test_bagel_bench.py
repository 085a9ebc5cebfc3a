"""benchmarks/bagel_bench.py: a --quick run (the tiny model on CPU) writes what it returns, with every case and,
with --profile, an op table of a decode step at concurrency 2 and of a denoising step."""

from __future__ import annotations

import json

import pytest

from benchmarks.bagel_bench import main

# a whole benchmark script: the slow group (tests/conftest.py: one_thread)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_quick_run(tmp_path) -> None:
    out = tmp_path / "bagel.json"
    doc = main(["--quick", "--profile", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["device"] == "cpu" and doc["dtype"] == "float32"
    for concurrency in (1, 2):
        case = doc["understanding"][f"c{concurrency}_t4"]
        assert case["tokens"] == 4 * concurrency and case["tokens_per_s"] > 0 and case["ttft_p50_s"] > 0
    assert doc["generation"]["image"] == [64, 64, 3] and doc["generation"]["seconds"] > 0
    assert doc["editing"]["image"] == [64, 64, 3] and doc["editing"]["steps"] == 3
    decode, denoise = doc["profile"]["decode_c2"], doc["profile"]["denoise_t2i"]
    assert decode["items"] == 2 and "aten::" in decode["table"]
    assert denoise["items"] >= 1 and "aten::" in denoise["table"]


def test_quick_run_of_both_settings(tmp_path) -> None:
    """--quantization none fp8 over the image cases: the FP8 setting's images against the float32 ones of the same
    seed (measured on the tiny model: 28.0 dB generation, 23.9 dB editing; finite, so FP8 was applied)."""
    out = tmp_path / "bagel.json"
    doc = main(["--quick", "--cases", "generation", "editing", "--quantization", "none", "fp8", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["quantization"] == "none" and "understanding" not in doc and "profile" not in doc
    fp8 = doc["settings"]["fp8"]
    assert set(fp8) == {"build_s", "generation", "editing", "peak_gb"}
    for name in ("generation", "editing"):
        assert fp8[name]["image"] == doc[name]["image"] == [64, 64, 3]
        assert 15 < fp8[name]["psnr_db_vs_none"] < 45 and fp8[name]["seconds_vs_none"] > 0, fp8[name]
