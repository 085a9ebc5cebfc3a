"""benchmarks/structured_decode.py: a --quick run (the tiny Llama on CPU) writes what it returns, times every
case at each batch, replaces rows whose JSON completes, and counts grammar host time only where rows are
constrained."""

from __future__ import annotations

import json

import pytest

from benchmarks.grammar_mask_cost import SCHEMAS
from benchmarks.structured_decode import bounded, main

pytest.importorskip("xgrammar")


def test_bounded_schemas_cap_every_string_and_array() -> None:
    nested = bounded(SCHEMAS["nested"])
    assert nested["properties"]["user"]["properties"]["email"] == {"type": "string", "maxLength": 8}
    assert nested["properties"]["scores"]["maxItems"] == 3
    tags = bounded(SCHEMAS["enum_array"])["properties"]["tags"]
    assert tags == {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}
    assert SCHEMAS["enum_array"]["properties"]["tags"]["maxItems"] == 4  # the original is left as it was


@pytest.mark.slow  # a whole benchmark script
def test_quick_run(tmp_path) -> None:
    out = tmp_path / "structured.json"
    doc = main(["--quick", "--batch", "1", "2", "--steps", "40", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert [row["batch"] for row in doc["rows"]] == [1, 2]
    for row in doc["rows"]:
        free = row["free"]
        assert free["ms_per_step"] > 0 and free["grammar_host_ms_per_step"] == 0 and free["json_completed"] == 0
        for name in ("json_schema", "json_schema_bounded"):
            case = row[name]
            assert case["grammar_host_ms_per_step"] > 0
            assert case["mask_cost_ms_per_step"] == pytest.approx(case["ms_per_step"] - free["ms_per_step"], abs=2e-3)
            assert len(row["runs"][name]) == 1
    assert sum(row["json_schema_bounded"]["json_completed"] for row in doc["rows"]) > 0  # rows were replaced
