"""Tool calls written in a chat model's own format: the grammar that forces one, and the parser that finds them.

Two formats, chosen from the chat template (`format_of`):
- `HERMES` (Qwen2.5/Qwen3, Hermes, our ChatML template): `<tool_call>{"name": f, "arguments": {...}}</tool_call>`,
  any number of them among text.
- `LLAMA3` (Llama 3.1+ JSON tool calling): the whole answer is one JSON object `{"name": f, "parameters": {...}}`.

`grammar` gives the `structured_outputs` spec (engines/grammar.py) of one call to one of the tools (or, in
`HERMES`, of one or more calls: OpenAI's `tool_choice` "required" with `parallel_tool_calls`), its arguments
valid under that tool's `parameters` schema; `ToolCallStream` splits streamed text into
content and calls, a call's arguments streamed as they are written when it begins with its name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function declared without `parameters`
# the head of a call object written name first (as forced calls are): its arguments follow
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class CallOpen:
    """A streamed call has begun: the function it names (its arguments follow as `CallArgs`)."""

    name: str


@dataclass(frozen=True, slots=True)
class CallArgs:
    """The next piece of the arguments of the call last opened."""

    text: str


Piece = str | ToolCall | CallOpen | CallArgs  # what a ToolCallStream hands out: content, or (part of) a call


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How one model family writes a call: between `begin` and `end` (both empty: the whole answer is the
    call), as a JSON object whose `name` names the function and whose `args_key` holds the arguments."""

    name: str
    begin: str
    end: str
    args_key: str

    def grammar(self, tools: Sequence[Mapping[str, Any]], only: str | None = None,
                several: bool = False) -> dict[str, Any]:
        """The `structured_outputs` spec of one call to `only` (a function name) or to any of `tools`
        (OpenAI tool objects, already checked); with `several`, of one or more calls, one a line, where the
        format writes calls between tags (a `LLAMA3` answer is one call)."""
        functions = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
        assert functions, f"no tool named {only!r}"
        options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                     self.args_key: f.get("parameters") or EMPTY_PARAMETERS},
                    "required": ["name", self.args_key], "additionalProperties": False} for f in functions]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        if not self.begin:
            return {"json_schema": schema}
        tagged = {"begin": self.begin, "schema": schema, "end": self.end}
        return {"tagged_json": {**tagged, "separator": "\n"} if several else tagged}

    def parse_call(self, text: str) -> ToolCall | None:
        """The call written as `text` (the JSON between begin and end), or None when it is not one."""
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get(self.args_key, obj.get("arguments", obj.get("parameters", {})))
        if not isinstance(args, dict | str):
            return None
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

    def stream(self) -> ToolCallStream:
        """A fresh splitter of one streamed answer, streaming arguments as they are written."""
        return ToolCallStream(self, incremental=True)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer split into its content (None when only calls and whitespace) and its calls."""
        stream = ToolCallStream(self)
        pieces = stream.push(text) + stream.finish()
        content = "".join(p for p in pieces if isinstance(p, str))
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        return (content if content.strip() else None), calls


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>", "arguments")
LLAMA3 = ToolCallFormat("llama3", "", "", "parameters")


def format_of(template: str) -> ToolCallFormat | None:
    """The call format a chat template source writes assistant calls in; None when it renders no calls."""
    if "<tool_call>" in template:
        return HERMES
    if "tool_calls" in template and "<|start_header_id|>" in template:
        return LLAMA3
    return None


def template_format(tokenizer: Any) -> ToolCallFormat | None:
    """The call format of the chat template a `Tokenizer` renders tools with; None when it has none or it
    writes no calls."""
    from mstar.models.common.chat_template import ChatTemplateError, select_template

    try:
        return format_of(select_template(tokenizer.config.chat_templates, None, has_tools=True))
    except ChatTemplateError:
        return None


@dataclass(slots=True)
class ToolCallStream:
    """Splits an answer arriving in pieces into content text and calls, in order. Text that may begin a call
    is held; with `incremental`, a call written name first goes out as `CallOpen` once its name is known and
    its arguments as `CallArgs` while written (held back: what may still be the call's closing `}`), others
    as a `ToolCall` once closed. A call never closed goes out as content at `finish`, unless it was opened.
    Whitespace is held until more content follows, so the whitespace around calls is dropped."""

    fmt: ToolCallFormat
    incremental: bool = False
    _buf: str = ""
    _space: str = ""  # whitespace content waiting for more content
    _whole: bool | None = None  # LLAMA3: whether the answer is a call (None: not known yet)
    _args_at: int | None = None  # where the open call's arguments begin in its body (None: not opened)
    _sent: int = 0  # characters of the open call's arguments handed out
    _out: list[Piece] = field(default_factory=list)

    def push(self, text: str) -> list[Piece]:
        """What `text`, after what came before, lets go out now."""
        self._buf += text
        if self.fmt.begin:
            self._split_tagged()
        elif self._whole is None and self._buf.strip():
            self._whole = self._buf.lstrip().startswith("{")
        if self._whole is False:
            self._content(self._buf)
            self._buf = ""
        elif self._whole:
            self._stream_args(self._buf)
        return self._take()

    def finish(self) -> list[Piece]:
        """What is left once the answer ended."""
        if self._args_at is not None:
            self._close(self._buf[len(self.fmt.begin):])
        elif (call := self.fmt.parse_call(self._buf) if self._whole else None) is not None:
            self._out.append(call)
        else:
            self._content(self._buf)
        self._buf = ""
        return self._take()

    def _split_tagged(self) -> None:
        begin, end = self.fmt.begin, self.fmt.end
        while True:
            start = self._buf.find(begin)
            if start < 0 and self._args_at is None:
                keep = next((k for k in range(min(len(begin) - 1, len(self._buf)), 0, -1)
                             if begin.startswith(self._buf[-k:])), 0)
                self._content(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            if self._args_at is None:
                self._content(self._buf[:start])
                self._buf = self._buf[start:]
            stop = self._buf.find(end, len(begin))
            if stop < 0:
                self._stream_args(self._buf[len(begin):])
                return
            body = self._buf[len(begin):stop]
            if self._args_at is not None:
                self._close(body)
            elif (call := self.fmt.parse_call(body)) is not None:
                self._space = ""
                self._out.append(call)
            else:
                self._content(self._buf[:stop + len(end)])
            self._buf = self._buf[stop + len(end):]

    def _stream_args(self, body: str) -> None:
        """Open the call whose unfinished `body` has begun with its name; hand out its arguments so far."""
        if not self.incremental:
            return
        if self._args_at is None:
            head = _CALL_HEAD.match(body)
            if head is None:
                return
            self._space, self._args_at, self._sent = "", head.end(), 0
            self._out.append(CallOpen(head.group(1)))
        rest = body[self._args_at:]
        brace = rest.rfind("}")
        tail = rest[brace + 1:].lstrip() if brace >= 0 else None
        ready = brace if tail is not None and self.fmt.end.startswith(tail) else len(rest.rstrip())
        self._send(rest[:ready])

    def _close(self, body: str) -> None:
        """The open call's body is complete: its arguments end before the call object's closing brace."""
        args = body[self._args_at:].rstrip()
        self._send(args[:-1].rstrip() if args.endswith("}") else args)
        self._args_at = None

    def _send(self, args: str) -> None:
        if len(args) > self._sent:
            self._out.append(CallArgs(args[self._sent:]))
            self._sent = len(args)

    def _content(self, text: str) -> None:
        if not text:
            return
        if not text.strip():
            self._space += text
            return
        self._out.append(self._space + text)
        self._space = ""

    def _take(self) -> list[Piece]:
        out, self._out = self._out, []
        return out
