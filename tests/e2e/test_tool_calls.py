"""Tool calling on chat from a tiny random Qwen3 (`mstar serve qwen3 --tiny`'s architecture and tokenizer, as a
checkpoint whose context is 2048 tokens: the Hermes tool preamble alone takes about 400 of the tiny tokenizer's
tokens, past --tiny's 512) through the unmodified openai client; the grammar alone makes a forced call
well-formed: tool_choice required gives one or more tool_calls (exactly one with parallel_tool_calls false) and
a named function one, whose arguments validate against the tool's schema, streamed and not; none gives text; a history with calls
and tool results renders; malformed tools and choices are 400s."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.e2e.server_thread import running_server
from tests.models.llm_runtime_testing import make_checkpoint

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit", "days"]}
SEARCH = {"type": "object", "properties": {
    "query": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}, "required": ["query", "tags"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_checkpoint("qwen3", path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    with running_server({"model": "qwen3", "device": "cpu", "kv_cache": {"max_num_pages": 512}},
                        runtime_kwargs={"model_path": str(path)}) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _create(client, seed: int, **kwargs):
    kwargs = {"messages": MESSAGES, "max_tokens": 200, **kwargs}
    return client.chat.completions.create(model="qwen3", tools=TOOLS, temperature=1.0, seed=seed, **kwargs)


def _check_call(name: str, arguments: str, want: str | None = None) -> None:
    assert name in SCHEMAS and (want is None or name == want), name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("seed", range(6))
def test_required_and_named_calls_validate(client, seed):
    named = {"type": "function", "function": {"name": "search"}}
    for choice, want, single in (("required", None, False), ("required", None, True), (named, "search", False)):
        extra = {"parallel_tool_calls": False} if single else {}
        choice_out = _create(client, seed, tool_choice=choice, max_tokens=400, **extra).choices[0]
        assert choice_out.finish_reason == "tool_calls", choice_out
        calls = choice_out.message.tool_calls
        assert len(calls) == 1 if single or want else len(calls) >= 1
        for call in calls:
            assert call.type == "function" and call.id
            _check_call(call.function.name, call.function.arguments, want)


@pytest.mark.parametrize("seed", range(3))
def test_streamed_calls_assemble_into_valid_calls(client, seed):
    for choice, want in (("required", None), ({"type": "function", "function": {"name": "get_weather"}},
                                              "get_weather")):
        calls: dict[int, dict] = {}
        finish, pieces = None, 0
        for event in _create(client, seed, tool_choice=choice, stream=True):
            for c in event.choices:
                finish = c.finish_reason or finish
                assert not (c.delta.content or "").strip(), c.delta  # a forced answer is the call alone
                for d in c.delta.tool_calls or []:
                    entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
                    pieces += bool(d.function.arguments)
        assert finish == "tool_calls" and list(calls) == list(range(len(calls))) and calls
        assert len(calls) == 1 or want is None
        assert pieces > 2  # the arguments streamed as written
        for call in calls.values():
            assert call["id"]
            _check_call(call["name"], call["arguments"], want)


def test_none_answers_text_and_auto_answers_something(client):
    for seed in range(3):
        out = _create(client, seed, tool_choice="none", max_tokens=16).choices[0]
        assert out.message.tool_calls is None and out.message.content is not None
        assert out.finish_reason != "tool_calls"
        out = _create(client, seed, tool_choice="auto", max_tokens=16).choices[0]
        assert out.message.content or out.message.tool_calls


def test_history_with_calls_and_results_is_accepted(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    out = _create(client, 0, messages=history, max_tokens=8).choices[0]
    assert out.message.content or out.message.tool_calls
    forced = _create(client, 1, messages=history, tool_choice="required").choices[0]
    _check_call(forced.message.tool_calls[0].function.name, forced.message.tool_calls[0].function.arguments)


@pytest.mark.parametrize(("tools", "choice", "match"), [
    ([{"type": "retrieval"}], "auto", "function"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], "auto", "object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}],
     "auto", "properties"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "name"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "missing"),
])
def test_bad_tools_are_refused(client, tools, choice, match):
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(model="qwen3", messages=MESSAGES, tools=tools, tool_choice=choice)


def test_a_forced_call_and_a_json_format_exclude_each_other(client):
    with pytest.raises(openai.BadRequestError, match="exclude each other"):
        _create(client, 0, tool_choice="required", response_format={"type": "json_object"})


def test_a_model_without_a_call_format_refuses_tools():
    with running_server({"model": "toy"}) as url:
        toy = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no tool-call format"):
            toy.chat.completions.create(model="toy", messages=MESSAGES, tools=TOOLS)
