"""Structured outputs on CUDA (tiny Qwen3 in bf16, decode CUDA graphs, sampler graphs, lookahead and step
graphs on): constrained rows leave the graphs for eager sampling on a masked copy of the logits, so 16
schemas answer valid JSON while free requests batched beside them still run to their length (their tokens
are not compared with a run alone: bf16 batches of other sizes may round differently)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from mstar.config import config_from_dict
from mstar.runtime.offline import MStar
from tests.json_schemas import top_schema

pytest.importorskip("xgrammar")

FREE = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 24}


@pytest.fixture(scope="module")
def served():
    with MStar(config=config_from_dict({"model": "qwen3", "kv_cache": {"max_num_pages": 512}}), tiny=True) as m:
        yield m


def _ids(handle) -> list[int]:
    return [int(t) for t in handle.result().outputs["text"] for t in t.reshape(-1).tolist()]


def test_constrained_rows_beside_free_rows(served):
    m = served
    schemas = [top_schema(seed) for seed in range(16)]
    constrained = [m.submit({"messages": [{"role": "user", "content": "JSON"}]}, temperature=1.0, seed=seed,
                            max_tokens=400, structured_outputs=json.dumps({"json_schema": s}))
                   for seed, s in enumerate(schemas)]
    free = [m.submit({"text": f"free request {i}"}, **FREE) for i in range(4)]
    for schema, handle in zip(schemas, constrained, strict=True):
        result = handle.decoded()
        text = "".join(result.outputs["text"])
        assert result.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert all(len(_ids(h)) == FREE["max_tokens"] for h in free)
