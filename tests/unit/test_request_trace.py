"""benchmarks/request_trace.py: busy and idle time of a device timeline, gaps by size, their neighbours."""

import pytest

from benchmarks.request_trace import timeline_summary


def test_overlapping_intervals_count_once_and_gaps_are_placed():
    kernels = [
        (0.0, 100.0, "gemm_a"),
        (50.0, 120.0, "norm_b"),      # overlaps gemm_a: busy 0..120
        (125.0, 130.0, "add_c"),      # 5 us gap
        (2130.0, 2200.0, "gemm_d"),   # 2 ms gap after add_c
        (2250.0, 2300.0, "copy_e"),   # 50 us gap
    ]
    s = timeline_summary(kernels)
    assert s["kernels"] == 5
    assert s["span_ms"] == pytest.approx(2.3)
    assert s["busy_ms"] == pytest.approx((120 + 5 + 70 + 50) / 1e3)
    assert s["idle_ms"] == pytest.approx((5 + 2000 + 50) / 1e3)
    assert s["idle_by_gap"]["lt_10us"] == {"ms": 0.005, "gaps": 1}
    assert s["idle_by_gap"]["10_100us"] == {"ms": 0.05, "gaps": 1}
    assert s["idle_by_gap"]["100us_1ms"] == {"ms": 0.0, "gaps": 0}
    assert s["idle_by_gap"]["ge_1ms"] == {"ms": 2.0, "gaps": 1}
    assert s["largest_gaps"][0] == {"idle_ms": 2.0, "after": "add_c", "before": "gemm_d"}
    assert s["kernel_ms_by_category"]["GEMM"] == pytest.approx(0.17)
    assert s["top_kernels"][0] == {"name": "gemm_a", "category": "GEMM", "ms": 0.1, "count": 1}
    assert [k["name"] for k in s["top_kernels"]] == ["gemm_a", "norm_b", "gemm_d", "copy_e", "add_c"]  # ties: first seen first


def test_convolutions_are_not_attention():
    s = timeline_summary([(0.0, 10.0, "sm90_xmma_fprop_implicit_gemm_tf32f32_nhwc"),
                          (10.0, 30.0, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16")])
    assert s["kernel_ms_by_category"]["conv"] == pytest.approx(0.01)
    assert s["kernel_ms_by_category"]["attention"] == pytest.approx(0.02)


def test_a_gap_follows_the_interval_that_ended_last():
    # a long kernel covers a short one that starts later: the gap is after the long kernel's end
    s = timeline_summary([(0.0, 500.0, "long"), (10.0, 20.0, "short"), (600.0, 610.0, "next")])
    assert s["largest_gaps"] == [{"idle_ms": 0.1, "after": "long", "before": "next"}]
    assert s["busy_ms"] == pytest.approx(0.51)


def test_empty_timeline():
    assert timeline_summary([]) == {"kernels": 0}
