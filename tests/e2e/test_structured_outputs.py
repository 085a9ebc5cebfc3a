"""Structured outputs from `mstar serve qwen3 --tiny` (random weights: the grammar alone makes the output
valid) through the unmodified openai client: 50 generated JSON schemas (nested objects, enums, arrays,
numbers, booleans, bounded strings) answered concurrently beside free-text requests, each answer parsing
and validating; /generate's choice and regex options; bad schemas and models without grammars refused."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from tests.e2e.server_thread import running_server
from tests.json_schemas import top_schema

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

SCHEMAS = 50


@pytest.fixture(scope="module")
def base():
    with running_server({"model": "qwen3", "device": "cpu", "kv_cache": {"max_num_pages": 512}}, tiny=True) as url:
        yield url


def _json_answer(client, seed: int) -> tuple[dict, str, str | None]:
    schema = top_schema(seed)
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
        jsonschema.validate(json.loads(text), schema)
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


def test_generate_refuses_a_misspelt_sampling_option(base):
    body = {"text": "hi", "stream": False, "options": {"max_tokens": 4, "temprature": 0.0}}
    resp = httpx.post(f"{base}/generate", json=body)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == "temprature", resp.text
    assert "model 'qwen3' takes no option 'temprature' (did you mean 'temperature'?)" in error["message"]
    assert "structured_outputs" in error["message"]  # the options it takes are listed


def test_chat_takes_the_models_options_and_refuses_a_misspelt_one(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    kwargs = dict(model="qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.0)
    assert client.chat.completions.create(**kwargs, extra_body={"top_k": 5, "skip_special_tokens": True}).choices
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kwargs, extra_body={"repetition_penlty": 1.2})
    assert info.value.body["param"] == "repetition_penlty"
    assert "(did you mean 'repetition_penalty'?)" in info.value.body["message"]


def _generated(base: str, body: dict) -> str:
    return "".join(c["delta"] for c in httpx.post(f"{base}/generate", json=body).json()["outputs"]["text"])


def test_a_model_without_grammars_refuses_structured_outputs():
    with running_server({"model": "toy"}) as url:
        resp = httpx.post(f"{url}/generate", json={"text": "hi", "options": {
            "structured_outputs": {"regex": "a+"}}, "stream": False})
    assert resp.status_code == 400 and "structured_outputs" in resp.text
