"""benchmarks/profile_wan.py: the kernel-name categories and SDPA backend detection, and a --quick run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.kernel_categories import CATEGORIES, categorize, sdpa_backends
from benchmarks.profile_wan import summarize_kernels

# Kernel names as they appear in H100/H200 torch.profiler traces (shortened).
FLASH = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false>, true>(Flash_fwd_params)"
CUDNN = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0"
EFFICIENT = "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)"
GEMM = "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_bias_TNT"
NORM = "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(...)"
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, ...>"


@pytest.mark.parametrize(("name", "category"), [
    (FLASH, "attention"), (CUDNN, "attention"), (EFFICIENT, "attention"), (GEMM, "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "GEMM"), (NORM, "norm"),
    (ADD, "elementwise/copy"), ("Memcpy DtoD (Device -> Device)", "elementwise/copy"),
    ("void at::native::reduce_kernel<512, 1, ...>", "other"), ("aten::addmm", "GEMM"),
])
def test_kernel_names_fall_in_the_expected_category(name: str, category: str) -> None:
    assert categorize(name) == category


def test_sdpa_backend_is_told_from_kernel_names() -> None:
    assert sdpa_backends([GEMM, FLASH, ADD]) == ["flash"]
    assert sdpa_backends([CUDNN]) == ["cudnn"]  # its name holds "flash" too: cuDNN wins
    assert sdpa_backends([EFFICIENT, "void (anonymous namespace)::softmax_warp_forward<...>"]) == ["efficient", "math"]
    assert sdpa_backends([GEMM, NORM]) == []


def test_summary_sums_categories_per_step() -> None:
    totals = {GEMM: [6000.0, 4], FLASH: [3000.0, 2], ADD: [1000.0, 8]}  # microseconds, calls over 2 steps
    out = summarize_kernels(totals, steps=2, top=2)
    assert out["kernel_ms_per_step"] == 5.0 and out["kernels_per_step"] == 7.0
    assert out["categories_ms"] == {"GEMM": 3.0, "attention": 1.5, "norm": 0.0, "elementwise/copy": 0.5, "other": 0.0}
    assert out["categories_calls"] == {"GEMM": 2.0, "attention": 1.0, "norm": 0.0, "elementwise/copy": 4.0, "other": 0.0}
    assert [k["name"] for k in out["top_kernels"]] == [GEMM, FLASH] and out["top_kernels"][0]["pct"] == 60.0
    assert out["sdpa_backends"] == ["flash"]


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_quick_run_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-m", "benchmarks.profile_wan", "--quick", "--batch", "2", "--steps", "2",
                    "--profile-steps", "1", "--out", str(out)], cwd=root, check=True, capture_output=True,
                   timeout=120)
    result = json.loads(out.read_text())
    rows = {row["variant"]: row for row in result["rows"]}
    assert set(rows) == {"eager", "eager_text_cached"}  # the cuDNN-first and graph rows are CUDA-only
    for row in rows.values():
        assert row["batch"] == 2 and row["wall_ms_per_step"] > 0
        assert set(row["categories_ms"]) == set(CATEGORIES)
        assert abs(sum(row["categories_ms"].values()) - row["kernel_ms_per_step"]) < 0.01
        assert row["categories_ms"]["attention"] > 0 and 0 < len(row["top_kernels"]) <= 25
    # the text's cross-attention K/V computed once: fewer GEMM launches a step (counted, not timed: CPU
    # timings of a tiny model swing)
    assert rows["eager"]["categories_calls"]["GEMM"] > rows["eager_text_cached"]["categories_calls"]["GEMM"] > 0


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_profile_wan_vae_quick_run(tmp_path: Path) -> None:
    """benchmarks/profile_wan_vae.py --quick --accuracy: every variant decodes the tiny VAE on CPU, is profiled
    and compared with the exact float32 decode."""
    out = tmp_path / "vae.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.profile_wan_vae", "--quick", "--accuracy", "--repeats", "1",
                           "--out", str(out)], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = {row["variant"]: row for row in doc["rows"]}
    assert set(rows) == {"float32", "float32_cl", "float32_cl_autotune", "float32_cl_chunk3", "float32_chunk3",
                         "float32_no_tf32", "bfloat16", "bfloat16_cl", "float32_cl_fp16conv"}
    for row in rows.values():
        assert row["decode_s"] > 0 and 0 < row["convolution_ms"] <= row["kernel_ms_per_step"]
    assert rows["float32_chunk3"]["chunk_frames"] == 3 and rows["bfloat16"]["dtype"] == "bfloat16"
    assert rows["float32_cl"]["channels_last"] and not rows["float32"]["channels_last"]
    assert rows["float32_cl_autotune"]["cudnn_autotune"] and not rows["float32_cl"]["cudnn_autotune"]
    assert rows["float32_cl_fp16conv"]["conv_dtype"] == "float16" and rows["float32_cl"]["conv_dtype"] == "float32"
    error = {name: row["accuracy"]["mean_abs"] for name, row in rows.items()}
    assert error["float32"] < 1e-6 and error["float32_cl"] < 1e-5  # float32 on the CPU: rounding alone
    assert 1e-5 < error["float32_cl_fp16conv"] < error["bfloat16_cl"] < 0.05
    assert rows["float32_cl_fp16conv"]["accuracy"]["max_levels"] <= 2
