"""benchmarks/transport_hops.py: a --quick --dist-cpu run (torch.distributed point-to-point under gloo: the
two-GPU run's NCCL code path on a CPU) writes every size's figures for the dist channel and for shared
memory, each case's received bytes checked equal in the benchmark; --devices asks for visible GPUs."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.transport_hops import _pattern, bytes_equal, main


@pytest.mark.slow  # two processes moving 256 MB tensors, about 8 s on 2 cores
def test_quick_dist_cpu_run(tmp_path) -> None:
    out = tmp_path / "hops.json"
    doc = main(["--quick", "--dist-cpu", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["dist_backend"] == "cpu:gloo" and doc["runtime_gpu_channel"] == "cuda_ipc"
    for size in ("1KB", "1MB", "256MB"):
        for kind in ("gloo", "shm"):
            case = doc["results"][f"host_{size}_{kind}"]
            assert case["bytes_equal"] is True, (size, kind)
            assert case["hop"]["n"] == 2 and case["hop"]["p50_us"] > 0 and case["bandwidth_GBps"] > 0
    host_cases = [case for name, case in doc["results"].items() if name.startswith("tensor_")]
    assert len(host_cases) == 5 and all(case["bytes_equal"] is True for case in host_cases)


def test_bytes_check_sees_one_changed_value_and_a_wrong_dtype() -> None:
    sent = _pattern(1000, 7)
    assert bytes_equal(sent.clone(), 7)
    changed = sent.clone()
    changed[999] += 1
    assert not bytes_equal(changed, 7)
    assert not bytes_equal(sent.view(torch.int32), 7)


def test_two_devices_need_two_visible_gpus(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match=r"--devices 0 1 needs GPU 1, but 1 GPU\(s\) are visible"):
        main(["--cuda", "--devices", "0", "1"])
