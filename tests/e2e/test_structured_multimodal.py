"""Structured outputs and tool calls beyond the Llama family, from tiny random models through the unmodified
openai client (random weights: the grammar alone makes every answer valid): the Qwen3-Omni thinker (its engine
masks the logits) and BAGEL's text answer (its stateless LLM component masks them where it samples). Each
answers several generated JSON schemas with JSON that validates, json_object with an object, tool_choice
required with one or more calls and a named function with one call whose arguments follow the tool's schema,
and /generate's choice option; BAGEL refuses a grammar on a thought before an image, Qwen3-Omni one on its
talker."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.e2e.server_thread import running_server
from tests.json_schemas import top_schema

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]
SCHEMAS = {"get_weather": WEATHER, "ping": {"type": "object", "properties": {}, "additionalProperties": False}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
SERVERS = {"qwen3_omni": {"model": "qwen3_omni", "device": "cpu"}, "bagel": {"model": "bagel"}}


# BAGEL in the default run; the Omni thinker (the autoregressive engine's grammar path, which the Llama tests
# also cover) in the slow group
@pytest.fixture(scope="module", params=["bagel", pytest.param("qwen3_omni", marks=pytest.mark.slow)])
def served(request, one_thread):
    with running_server(SERVERS[request.param], runtime_kwargs={"tiny": True}) as url:
        yield request.param, url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


def _chat(served, seed: int, **kwargs):
    model, _, client = served
    kwargs = {"messages": MESSAGES, "max_tokens": 300, "temperature": 1.0, "seed": seed, **kwargs}
    return client.chat.completions.create(model=model, **kwargs).choices[0]


def test_json_schemas_and_json_object_answers_validate(served):
    for seed in range(6):
        schema = top_schema(seed)
        out = _chat(served, seed, response_format={"type": "json_schema", "json_schema": {
            "name": f"s{seed}", "schema": schema, "strict": True}})
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.message.content), schema)
    # any object: its strings are unbounded, so random weights may run out of tokens first; seeds are tried until
    # one answer ends (3 first: the Qwen3-Omni thinker's ends, the others run to max_tokens), and it must parse
    ends = []
    for seed in (3, 0, 1, 2):
        ends.append(_chat(served, seed, response_format={"type": "json_object"}, max_tokens=600))
        if ends[-1].finish_reason == "stop":
            break
    assert ends[-1].finish_reason == "stop", ends
    assert isinstance(json.loads(ends[-1].message.content), dict)


def test_forced_tool_calls_follow_the_tool_schemas(served):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        for choice, want, parallel in (("required", None, True), ("required", None, False), (named, "get_weather", True)):
            out = _chat(served, seed, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
            assert out.message.tool_calls, out
            # one or more calls may run into max_tokens (random weights need not stop): the calls closed count
            assert out.finish_reason == "tool_calls" or parallel and want is None and out.finish_reason == "length"
            assert len(out.message.tool_calls) == 1 or parallel and want is None
            for call in out.message.tool_calls:
                assert call.function.name in SCHEMAS and (want is None or call.function.name == want)
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    out = _chat(served, 1, messages=history, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert out.finish_reason == "tool_calls" and out.message.tool_calls, out


def test_generate_follows_a_choice(served):
    model, url, _ = served
    for seed in range(3):
        body = {"text": "pick one", "stream": False, "options": {
            "temperature": 1.0, "seed": seed, "max_tokens": 20, "structured_outputs": {"choice": ["yes", "no"]}}}
        outputs = httpx.post(f"{url}/generate", json=body, timeout=300).json()["outputs"]
        assert "".join(c["delta"] for c in outputs["text"]) in ("yes", "no"), outputs


def test_bad_grammars_are_refused(served):
    model, url, client = served
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        client.chat.completions.create(model=model, messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 7}}})
    options, needle = ({"modalities": ["text", "image"], "structured_outputs": {"json_object": True}}, "thought") \
        if model == "bagel" else ({"talker.structured_outputs": {"json_object": True}}, "only the thinker")
    resp = httpx.post(f"{url}/generate", json={"text": "a cat", "stream": False, "options": options}, timeout=300)
    assert resp.status_code == 400 and needle in resp.text, resp.text
