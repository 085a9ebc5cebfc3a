"""benchmarks/bagel_bench.py: a --quick run (the tiny model on CPU) writes what it returns, with every case and,
with --profile, an op table of a decode step at concurrency 2 and of a denoising step; several settings (quantizations,
configs) in one run are compared to the first."""

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
    assert doc["mode"] == "inproc" and doc["workers"] == ["cpu"]
    assert set(fp8) == {"config", "quantization", "workers", "build_s", "generation", "editing", "peak_gb"}
    for name in ("generation", "editing"):
        assert fp8[name]["image"] == doc[name]["image"] == [64, 64, 3]
        assert 15 < fp8[name]["psnr_db_vs_none"] < 45 and fp8[name]["seconds_vs_none"] > 0, fp8[name]
        assert fp8[name]["latents_max_abs_diff_vs_none"] > 1e-3, fp8[name]  # FP8 moved the latents


def test_quick_run_of_two_configs(tmp_path) -> None:
    """--configs bagel bagel_cfg_parallel: both deployments run as worker processes (three for the guidance
    branches' placement), and the spread branches give the one-worker images and final latents up to float32
    noise (measured: at most 1.5e-5 on latents of scale 6 to 8, a pixel off by at most 1)."""
    out = tmp_path / "bagel.json"
    doc = main(["--quick", "--cases", "generation", "editing", "--configs", "bagel", "bagel_cfg_parallel",
                "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["config"] == "bagel" and doc["mode"] == "multiproc" and doc["workers"] == ["cpu"]
    spread = doc["settings"]["bagel_cfg_parallel"]
    assert spread["workers"] == ["cpu"] * 3 and "peak_gb" not in spread
    for name in ("generation", "editing"):
        case = spread[name]
        assert case["image"] == doc[name]["image"] == [64, 64, 3] and case["seconds_vs_bagel"] > 0
        assert doc[name]["latents_max_abs"] > 1
        assert case["latents_max_abs"] == pytest.approx(doc[name]["latents_max_abs"], abs=1e-3)
        assert case["latents_max_abs_diff_vs_bagel"] <= 1e-4, case
        assert case["max_pixel_diff_vs_bagel"] <= 1 and case["psnr_db_vs_bagel"] > 60, case
