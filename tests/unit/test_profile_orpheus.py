"""benchmarks/profile_orpheus.py --quick runs on CPU and writes its per-step split."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # runs a whole script or kernel check; CI's slow group runs it
def test_quick_profile_writes_the_split(tmp_path):
    root = Path(__file__).parents[2]
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.profile_orpheus", "--quick", "--tokens", "20",
                           "--concurrency", "1", "2", "--out", str(out)], cwd=root, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"c1", "c2"}
    for case in cases.values():
        assert case["llm_steps"] >= 19 and case["snac_steps"] >= 1
        assert case["llm_host_ms_per_step"]["llm_graph_launch"] > 0
    assert "host ms/step llm_wait" in proc.stdout
