"""benchmarks/profile_omni.py: a --quick run (tiny Qwen3-Omni on CPU) and its helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.call_timing import CATEGORIES, categorize, summarize_kernels, time_calls
from benchmarks.profile_omni import COMPONENTS, main, parse_args
from benchmarks.profile_omni_report import timed_rows


@pytest.fixture(scope="module")
def quick_doc(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("profile") / "omni.json"
    doc = main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))  # what was written is what was returned
    return doc


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_quick_run_times_every_component_without_errors(quick_doc: dict) -> None:
    cases = quick_doc["cases"]
    assert set(cases) == set(COMPONENTS) | {"frame_loop"}
    errors = {name: c["error"] for name, c in cases.items() if "error" in c}
    assert not errors
    assert quick_doc["command"].startswith("python3 benchmarks/profile_omni.py --quick")
    for name in COMPONENTS:
        assert quick_doc["components"][name]["weights_gib"] >= 0 and quick_doc["components"][name]["build_s"] >= 0


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_quick_run_decoder_cases_ran_the_real_engine_paths(quick_doc: dict) -> None:
    talker, thinker = quick_doc["cases"]["talker"], quick_doc["cases"]["thinker"]
    steps = 3  # the --quick default
    for b in (1, 2):
        # CPU: no graphs, so every talker step and every spoken-answer thinker step runs eagerly with extras
        assert talker[f"extras_b{b}"]["paths"]["eager_extras"] == steps
        assert thinker[f"extras_b{b}"]["paths"]["eager_extras"] == steps
        assert thinker[f"plain_b{b}"]["paths"]["eager_extras"] == 0
        assert talker[f"extras_b{b}"]["wall_ms"] > 0 and talker[f"extras_b{b}"]["forward_gpu_ms"] is None
    frame = quick_doc["cases"]["frame_loop"]["b2"]
    assert set(frame["host_ms_split"]) == {"code_predictor", "talker_input", "talker_submit", "talker_step"}
    assert frame["frame_ms"] == pytest.approx(sum(frame["host_ms_split"].values()), abs=0.01)


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_quick_run_codec_cases(quick_doc: dict) -> None:
    c2w, predictor = quick_doc["cases"]["code2wav"], quick_doc["cases"]["code_predictor"]
    assert c2w["first_call_after_build_ms"] > 0
    assert "warm_up_s" not in quick_doc["components"]["code2wav"]  # the builder warms up on CUDA only
    padded = c2w["float32_padded"]["new_length_b1_ms"]
    assert [row["frames"] for row in padded] == [28, 29]
    variant = c2w["float32"]  # CPU serves float32; the cuDNN variants only run on CUDA
    assert {"first_chunk_b1", "chunk_b1", "chunk_b2"} <= set(variant)
    assert [row["frames"] for row in variant["new_length_b1_ms"]] == [26, 27]  # lengths not run before
    kernels = variant["chunk_b1"]["kernels"]
    assert kernels["kernels"] > 0 and kernels["categories_ms"]["conv"] > 0
    assert abs(sum(kernels["categories_ms"].values()) - kernels["kernel_ms"]) < 0.01
    assert len(variant["stages_chunk_b1_ms"]) == 1 + 1 + 5  # transformer, one upsample stage, 5 decoder layers (tiny)
    assert predictor["graph_sizes"] == [] and "eager_sampled_b2" in predictor
    rows = dict(timed_rows(quick_doc))
    assert "code2wav.float32.chunk_b1" in rows and "frame_loop.b1" in rows


def test_time_calls_counts_every_call() -> None:
    calls = []
    out = time_calls(lambda: calls.append(1), torch.device("cpu"), calls=5, warmup=2)
    assert len(calls) == 1 + 1 + 5  # the first (cold) call, one more warm-up, the timed calls
    assert out["first_ms"] >= 0 and out["wall_ms"] >= out["host_ms"] * 0.5


def test_conv_kernels_get_their_own_category() -> None:
    assert categorize("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwkc") == "conv"
    assert categorize("sm90_xmma_dgrad_implicit_gemm_indexed_bf16") == "conv"
    assert categorize("void at::native::col2im_kernel<float>") == "conv"
    assert categorize("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention"
    assert categorize("nvjet_tst_128x64_64x8_1x1_v_bz_TNT") == "GEMM"
    out = summarize_kernels({"xmma_fprop_implicit_gemm": [3000.0, 2], "nvjet_gemm": [1000.0, 2]}, calls=2, top=5)
    assert set(out["categories_ms"]) == set(CATEGORIES)
    assert out["categories_ms"]["conv"] == 1.5 and out["categories_ms"]["GEMM"] == 0.5 and out["kernels"] == 2.0


def test_bad_component_names_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--quick", "--components", "vocoder"])
    assert "vocoder" in capsys.readouterr().err


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_cprofile_option_reports_the_talk_loop_host_functions(tmp_path: Path) -> None:
    out = tmp_path / "omni.json"
    doc = main(["--quick", "--components", "talker", "talker_input", "code_predictor", "--batches", "2",
                "--cprofile", "2", "--out", str(out)])
    prof = doc["cases"]["frame_loop_cprofile"]
    assert prof["batch"] == 2 and prof["frames"] == 2
    for key in ("by_tottime", "by_cumulative"):
        assert prof[key][0].split() == ["ncalls", "tottime", "percall", "cumtime", "percall", "filename:lineno(function)"]
        assert len(prof[key]) > 10
    assert any("frame_loop" in line for line in prof["by_cumulative"])
    assert any("engine.py" in line and "(step)" in line for line in prof["by_cumulative"])
