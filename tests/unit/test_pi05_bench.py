"""benchmarks/pi05_bench.py: a --quick run (the tiny policy on CPU, a live server, openpi clients, and
transformers' PI0 as the baseline) writes what it returns, with every case measured (#39).
benchmarks/pi05_stages.py --quick times every stage at each batch size and, with --profile, names the top ops
of one prefix and one flow call."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("openpi_client")
pytest.importorskip("transformers")
# a whole benchmark script: the slow group (tests/conftest.py: one_thread)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_quick_run(tmp_path) -> None:
    from benchmarks.pi05_bench import main

    out = tmp_path / "pi05.json"
    doc = main(["--quick", "--requests", "2", "--concurrency", "1", "3", "--per-robot", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["device"] == "cpu" and doc["latency"]["actions_shape"] == [10, 7]
    assert doc["latency"]["websocket"]["n"] == 2 and doc["latency"]["websocket"]["p50_ms"] > 0
    assert doc["latency"]["in_server"]["p99_ms"] <= doc["latency"]["websocket"]["p99_ms"]
    cpu = doc["latency"]["cpu_ms_per_chunk"]  # in process here (no CUDA): the policy's compute is this process's
    assert cpu["server"] > 0 and cpu["workers"] < cpu["server"]
    assert set(doc["throughput"]) == {"c1", "c3"} and doc["throughput"]["c3"]["chunks_per_s"] > 0
    assert doc["throughput"]["c3"]["n"] == 6
    assert doc["baseline"]["sample_actions"]["p50_ms"] > 0 and doc["baseline"]["prefix_tokens"] > 3 * 16


def test_stages_quick_run(tmp_path) -> None:
    """benchmarks/pi05_stages.py: every stage timed at each batch size, the prompt's prefix bucket named, the
    profiled calls' top ops (the flow's attention among them) at the first batch size."""
    from benchmarks.pi05_stages import TOP, main

    out = tmp_path / "stages.json"
    doc = main(["--quick", "--repeats", "1", "--batch", "1", "3", "--profile", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert set(doc["cases"]) == {"eager_b1", "eager_b3"}
    assert all(value > 0 for case in doc["cases"].values() for value in case.values())
    assert doc["prefix_bucket"] >= doc["prefix_tokens"] == 3 * 16 + 80
    profile = doc["profile"]
    assert (profile["mode"], profile["batch"]) == ("eager", 1)
    for stage in ("prefix", "flow"):
        top = profile[stage]["top"]
        assert len(top) == TOP and top == sorted(top, key=lambda row: -row["us"])
        assert 0 < sum(row["us"] for row in top) <= profile[stage]["total_us"]
    assert any("attention" in row["name"] for row in profile["flow"]["top"])


def test_host_run(tmp_path) -> None:
    """benchmarks/pi05_bench.py --host: the full robot's sizes reach the server (three 224x224 cameras, 32-entry
    state, chunks of 50 x 32), every part of the host's time is measured, and the timed functions are put back."""
    from benchmarks.pi05_bench import main
    from mstar.models.pi05.processor import Pi05Processor

    inputs = Pi05Processor.inputs
    out = tmp_path / "host.json"
    doc = main(["--host", "--requests", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["robot"] == {"cameras": ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"],
                            "image_size": [224, 224], "state_dim": 32, "action_shape": [50, 32]}
    parts = doc["ms_p50"]
    assert doc["requests"] == 3 and all(parts[k] > 0 for k in ("compute", "request", "engine_host", "response"))
    assert parts["compute"] < parts["in_server"] and parts["host"] > parts["request"]
    assert Pi05Processor.inputs is inputs
