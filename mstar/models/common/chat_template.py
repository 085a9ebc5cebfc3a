"""Chat template rendering with jinja2, following Hugging Face's conventions.

Templates run in an immutable sandbox with `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, a `{% generation %}` block (rendered as its body), a `tojson` filter that does not escape
HTML and accepts `indent`/`separators`/`sort_keys`, and the globals `raise_exception(msg)` and
`strftime_now(fmt)`. Templates see `messages`, `tools`, `documents`, `add_generation_prompt`, the
tokenizer's special tokens (`bos_token`, `eos_token`, ...) and any extra keyword arguments.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any


class ChatTemplateError(ValueError):
    """A chat template is missing, cannot be chosen, or refused the conversation."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & for HTML; chat prompts want the raw characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_template(source: str):
    """Compile (and cache) a chat template in the sandboxed environment described in the module doc."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; we only render it.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def select_template(templates: Mapping[str, str], name_or_source: str | None, has_tools: bool) -> str:
    """Pick the template source: an explicit source or name, else `tool_use` when tools are given, else
    `default`. `templates` maps names to sources (a single template is stored under `default`)."""
    if name_or_source is not None:
        return templates.get(name_or_source, name_or_source)
    if has_tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    if templates:
        raise ChatTemplateError(f"this tokenizer has several chat templates {sorted(templates)} and no "
                                "'default'; pass chat_template=<name>")
    raise ChatTemplateError(
        "this tokenizer has no chat template (none in tokenizer_config.json, chat_template.jinja or "
        "chat_template.json); pass chat_template=<jinja source>, e.g. "
        "mstar.models.common.chat_templates.CHATML_TEMPLATE for the <|im_start|> layout")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain dict copies of the messages; each must have a role, content a string, a list of parts or None."""
    if not messages:
        raise ChatTemplateError("cannot render an empty conversation; pass at least one message")
    out = []
    for i, message in enumerate(messages):
        msg = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
        if "role" not in msg:
            raise ChatTemplateError(f"message {i} has no 'role': {msg!r}")
        content = msg.get("content")
        if content is not None and not isinstance(content, str | list | tuple):
            raise ChatTemplateError(f"message {i} content must be a string or a list of parts, got "
                                    f"{type(content).__name__}")
        if isinstance(content, tuple):
            msg["content"] = list(content)
        out.append(msg)
    return out


def render_chat(source: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                tools: Sequence[Mapping[str, Any]] | None = None,
                documents: Sequence[Mapping[str, Any]] | None = None, **variables: Any) -> str:
    """Render one conversation with a chat template source; jinja template errors become ChatTemplateError."""
    import jinja2

    template = compile_template(source)
    try:
        return template.render(messages=normalize_messages(messages),
                               tools=list(tools) if tools is not None else None,
                               documents=list(documents) if documents is not None else None,
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
