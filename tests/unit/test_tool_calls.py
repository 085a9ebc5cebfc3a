"""Tool-call formats: the format a chat template writes, calls parsed out of whole and streamed answers,
and the grammar spec of a forced call."""

from __future__ import annotations

import json

from mstar.engines.grammar import canonical_spec
from mstar.models.common.chat_templates import CHATML_TEMPLATE, LLAMA3_TEMPLATE
from mstar.models.common.tool_calls import HERMES, LLAMA3, ToolCall, format_of

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "g"}}]


def test_the_template_chooses_the_format():
    assert format_of(CHATML_TEMPLATE) is HERMES
    assert format_of(LLAMA3_TEMPLATE) is LLAMA3
    assert format_of("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_hermes_calls_among_text():
    text = 'Let me look. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name":"g","arguments":{}}</tool_call>'
    assert HERMES.parse(text) == ("Let me look. ", [ToolCall("f", '{"x": 1}'), ToolCall("g", "{}")])
    assert HERMES.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert HERMES.parse("cut <tool_call>{\"name\"") == ("cut <tool_call>{\"name\"", [])


def test_llama3_call_is_the_whole_answer():
    assert LLAMA3.parse(' {"name": "f", "parameters": {"x": 2}}') == (None, [ToolCall("f", '{"x": 2}')])
    assert LLAMA3.parse("hello {") == ("hello {", [])


def test_a_stream_holds_only_what_may_begin_a_call():
    stream, out = HERMES.stream(), []
    for ch in 'ab<tool_call>{"name":"f","arguments":{"x":3}}</tool_call> done <tool':
        pieces = stream.push(ch)
        assert "<" not in "".join(p for p in pieces if isinstance(p, str))
        out += pieces
    out += stream.finish()
    assert "".join(p for p in out if isinstance(p, str)) == "ab done <tool"
    assert [p for p in out if isinstance(p, ToolCall)] == [ToolCall("f", '{"x": 3}')]


def test_forced_call_grammars():
    spec = HERMES.grammar(TOOLS)
    body = spec["tagged_json"]
    assert (body["begin"], body["end"]) == ("<tool_call>", "</tool_call>")
    assert [o["properties"]["name"] for o in body["schema"]["anyOf"]] == [{"const": "f"}, {"const": "g"}]
    assert json.loads(canonical_spec(spec)) == spec
    named = LLAMA3.grammar(TOOLS, "g")["json_schema"]
    assert named["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert named["required"] == ["name", "parameters"]
