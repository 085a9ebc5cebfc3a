"""benchmarks/results_io.py: result files are named by GPU kind, whatever the card's full name."""

from __future__ import annotations

import pytest

from benchmarks.results_io import gpu_tag, write_results


@pytest.mark.parametrize(("name", "tag"), [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                           ("NVIDIA A100-SXM4-80GB", "a100"), ("Some Future Card", "gpu")])
def test_gpu_tag_names_the_kind_not_the_last_word(name, tag):
    assert gpu_tag(name) == tag


def test_a_quick_run_writes_only_where_told(tmp_path):
    assert write_results({"a": 1}, None, True, "x") is None
    path = write_results({"a": 1}, str(tmp_path / "r.json"), True, "x")
    assert path is not None and path.read_text() == '{\n  "a": 1\n}\n'
