"""AutoregressiveEngine with attention backend 'triton' (kernels interpreted on CPU) gives the greedy
tokens of the dense reference: chunked prefill, mixed prefill + decode batches, then decode; and so
does it with decode graphs (CPU stand-ins), whose steps reach the kernels through the packed decode
inputs the backend shares (the graphed cases in the slow group)."""

import json
from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")

CASES = Path(__file__).parents[1] / "unit" / "paged_attention_cases.py"


def _run(*cases: str) -> dict:
    """Engine cases in one fresh interpreter: TRITON_INTERPRET must be set before kernels are decorated."""
    proc = run_interpreted(CASES, *cases)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results() -> dict:
    return _run("engine_greedy")


@pytest.fixture(scope="module")
def graphed() -> dict:
    """The graphed cases (the slow group): the same kernels through the decode and prefill graphs' inputs."""
    return _run("engine_graphed", "engine_prefill_graphed")


def _result(results: dict, case: str) -> dict:
    result = results[case]
    assert "error" not in result, result.get("error")
    return result


def test_engine_with_triton_backend_matches_reference(results: dict) -> None:
    result = _result(results, "engine_greedy")
    assert result["got"] == result["want"]
    assert all(len(t) == 3 for t in result["got"])


@pytest.mark.slow
def test_graphed_decode_through_packed_inputs_matches_reference(graphed: dict) -> None:
    result = _result(graphed, "engine_graphed")
    assert result["got"] == result["want"] and all(len(t) == 6 for t in result["got"])
    assert result["shared"] and result["replays"] >= 5 and result["lookahead_steps"] > 0


@pytest.mark.slow
def test_graphed_prefill_steps_match_reference(graphed: dict) -> None:
    """Chunked prefills and mixed prefill + decode steps through the prefill graphs (padded token
    buckets, the backend's graphed-prefill description): the reference's greedy tokens, and no step
    ran eagerly."""
    result = _result(graphed, "engine_prefill_graphed")
    assert result["got"] == result["want"] and all(len(t) == 6 for t in result["got"])
    assert result["prefill_replays"] >= 3 and result["eager_steps"] == [], result
    assert result["decode_replays"] >= 5
    assert "graphed prefill step of 6 tokens in a bucket of 5" in result["refused"]
    assert result["dummy_ok"]  # a capture's dummy batch (8 tokens over the backend's 4 rows) runs
