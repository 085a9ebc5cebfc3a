"""benchmarks/cosmos3_bench.py: a --quick run (tiny networks on CPU, diffusers' pipeline beside ours) writes
what it returns, with every case's figures."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from benchmarks.cosmos3_bench import main  # noqa: E402

# a whole benchmark script: the slow group (tests/conftest.py: one_thread)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_quick_run(tmp_path) -> None:
    out = tmp_path / "cosmos3.json"
    doc = main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["device"] == "cpu" and doc["dtype"] == "float32"
    ours, theirs = doc["mstar"], doc["diffusers"]
    for size in ("64x64", "96x64"):
        assert ours[f"t2i_{size}_s"] > 0 and theirs[f"t2i_{size}_s"] > 0 and doc["speedup"][f"t2i_{size}"] > 0
    assert ours["t2i_64x64_c2_images_per_s"] > 0 and theirs["t2i_64x64_images_per_s"] > 0
    assert ours["t2v_s"] > 0 and theirs["t2v_s"] > 0
    assert 0 < ours["policy_p50_s"] <= ours["policy_p99_s"] and ours["policy_c2_chunks_per_s"] > 0
    assert theirs["policy_p50_s"] > 0
