"""Structured outputs on CUDA (tiny Qwen3 in bf16, decode CUDA graphs, sampler graphs, lookahead and step
graphs on): 16 schemas answer valid JSON while free requests batched beside them still run to their length
(their tokens are not compared with a run alone: bf16 batches of other sizes may round differently).
Seeded constrained rows sample eagerly, their logits masked in place (engines/token_masks.py); unseeded
ones are drawn by the sampler and step graphs, which apply the masks themselves, and run ahead."""

from __future__ import annotations

import json

import jsonschema
import pytest

from mstar.config import config_from_dict
from mstar.engines.autoregressive import AutoregressiveEngine
from mstar.engines.own_stream import OwnStreamEngine
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


def _engine(m) -> AutoregressiveEngine:
    engine = m.runtime.workers[0].engines["llm"]
    return engine.engine if isinstance(engine, OwnStreamEngine) else engine


@pytest.mark.parametrize("seeded", [True, False])
def test_constrained_rows_beside_free_rows(served, seeded):
    m = served
    engine = _engine(m)
    assert engine.step_graphs is not None and engine.masks is not None
    before = (engine.step_graphs.replays, engine.lookahead_steps, engine.masks.staged)
    schemas = [top_schema(seed) for seed in range(16)]
    constrained = [m.submit({"messages": [{"role": "user", "content": "JSON"}]}, temperature=1.0,
                            max_tokens=400, structured_outputs=json.dumps({"json_schema": s}),
                            **({"seed": seed} if seeded else {}))
                   for seed, s in enumerate(schemas)]
    free = [m.submit({"text": f"free request {i}"}, **FREE) for i in range(4)]
    for schema, handle in zip(schemas, constrained, strict=True):
        result = handle.decoded()
        text = "".join(result.outputs["text"])
        assert result.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert all(len(_ids(h)) == FREE["max_tokens"] for h in free)
    replays, ahead, staged = (engine.step_graphs.replays, engine.lookahead_steps, engine.masks.staged)
    assert staged > before[2] and ahead > before[1]  # masked steps, and constrained rows ran ahead
    if not seeded:  # rows the graphs serve: most masked steps were step-graph replays
        assert replays - before[0] > (staged - before[2]) // 2
