"""Readers for the small JSON/jinja files next to a checkpoint's `tokenizer.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} if the file does not exist; a malformed file raises naming it."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); fix or remove the file") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def token_content(value: Any) -> str:
    """Token text from a config entry: a plain string or a serialized AddedToken ({"content": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token entry {value!r} is neither a string nor an AddedToken dict")


def _templates_from_config(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        return {item["name"]: item["template"] for item in value}
    if isinstance(value, dict):
        return dict(value)
    raise ValueError(f"chat_template must be a string or a list of {{name, template}}, got {type(value).__name__}")


def load_chat_templates(folder: Path, tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """Named chat templates of a checkpoint folder, as transformers resolves them.

    Order (later wins for the same name): tokenizer_config.json `chat_template`, chat_template.json
    (processor style), chat_template.jinja (the `default`), additional_chat_templates/<name>.jinja.
    """
    templates = _templates_from_config(tokenizer_config.get("chat_template"))
    processor = read_json(folder / "chat_template.json").get("chat_template")
    templates.update(_templates_from_config(processor))
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    return templates
