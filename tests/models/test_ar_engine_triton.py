"""AutoregressiveEngine with attention backend 'triton' (kernels interpreted on CPU) gives the greedy
tokens of the dense reference: chunked prefill, mixed prefill + decode batches, then decode."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CASES = Path(__file__).parents[1] / "unit" / "paged_attention_cases.py"


def test_engine_with_triton_backend_matches_reference() -> None:
    # TRITON_INTERPRET must be set before kernels are decorated: run in a fresh interpreter.
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(CASES.parents[2])}
    proc = subprocess.run([sys.executable, str(CASES), "engine_greedy"], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])["engine_greedy"]
    assert "error" not in result, result.get("error")
    assert result["got"] == result["want"]
    assert all(len(t) == 3 for t in result["got"])
