"""Structured outputs from `mstar serve qwen3 --tiny` (random weights: the grammar alone makes the output
valid) through the unmodified openai client: 50 generated JSON schemas (nested objects, enums, arrays,
numbers, booleans, bounded strings) answered concurrently beside free-text requests, each answer parsing
and validating; /generate's choice and regex options; bad schemas and models without grammars refused."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.server_thread import running_server

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

SCHEMAS = 50


def _schema(rng: random.Random, depth: int = 0) -> dict:
    """A random schema whose every value is bounded, so random weights finish it within max_tokens."""
    kinds = ["string", "integer", "boolean", "enum", "number"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "ok", "no"], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": _schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    if kind == "object":
        names = rng.sample(["id", "name", "tags", "score", "flag", "kind", "child"], rng.randint(1, 3))
        return {"type": "object", "properties": {n: _schema(rng, depth + 1) for n in names}, "required": names,
                "additionalProperties": False}
    if kind == "integer":
        return {"type": "integer", "minimum": -100, "maximum": rng.randint(1, 999)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 10}
    return {"type": kind}


def _top_schema(seed: int) -> dict:
    rng = random.Random(seed)
    names = rng.sample(["user", "items", "colour", "count", "ok", "meta"], rng.randint(1, 4))
    return {"type": "object", "properties": {n: _schema(rng) for n in names}, "required": names,
            "additionalProperties": False}


@pytest.fixture(scope="module")
def base():
    with running_server({"model": "qwen3", "device": "cpu", "kv_cache": {"max_num_pages": 512}}, tiny=True) as url:
        yield url


def _json_answer(client, seed: int) -> tuple[dict, str, str | None]:
    schema = _top_schema(seed)
    resp = client.chat.completions.create(
        model="qwen3", messages=[{"role": "user", "content": "Answer in JSON."}], temperature=1.0, seed=seed,
        max_tokens=400, response_format={"type": "json_schema",
                                         "json_schema": {"name": f"s{seed}", "schema": schema, "strict": True}})
    return schema, resp.choices[0].message.content, resp.choices[0].finish_reason


def _free_answer(client, seed: int) -> str:
    return client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "hi"}],
                                          temperature=1.0, seed=seed, max_tokens=12).choices[0].message.content


def test_fifty_schemas_answer_valid_json_beside_free_text(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    with ThreadPoolExecutor(8) as pool:
        free = [pool.submit(_free_answer, client, s) for s in range(8)]
        answers = list(pool.map(lambda s: _json_answer(client, s), range(SCHEMAS)))
    for schema, text, finish in answers:
        assert finish == "stop", (schema, text)
        jsonschema_rs.validate(schema, json.loads(text))
    assert len({text for _, text, _ in answers}) > SCHEMAS // 2  # the model chose, not a fixed template
    assert all(f.result() is not None for f in free)
    plain = _free_answer(client, 3)
    assert plain == free[3].result()  # a free-text request batched with constrained ones is unchanged


def test_bad_response_formats_are_refused(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="json_schema.schema"):
        client.chat.completions.create(model="qwen3", messages=messages, response_format={"type": "json_schema"})
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        client.chat.completions.create(model="qwen3", messages=messages, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 7}}})


def test_generate_follows_a_choice_and_a_regex(base):
    for seed in range(4):
        body = {"text": "pick one", "options": {"temperature": 1.0, "seed": seed, "max_tokens": 20,
                                                "structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
                "stream": False}
        assert _generated(base, body) in ("yes", "no", "maybe so")
        body["options"]["structured_outputs"] = {"regex": "[a-c]{3}-[0-9]{2}"}
        text = _generated(base, body)
        assert re.fullmatch("[a-c]{3}-[0-9]{2}", text), text


def _generated(base: str, body: dict) -> str:
    return "".join(c["delta"] for c in httpx.post(f"{base}/generate", json=body).json()["outputs"]["text"])


def test_a_model_without_grammars_refuses_structured_outputs():
    with running_server({"model": "toy"}) as url:
        resp = httpx.post(f"{url}/generate", json={"text": "hi", "options": {
            "structured_outputs": {"regex": "a+"}}, "stream": False})
    assert resp.status_code == 400 and "structured_outputs" in resp.text
