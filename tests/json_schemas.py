"""Random JSON schemas for structured-output tests: nested objects, enums, arrays, numbers, booleans and
bounded strings, every value bounded so that random weights, guided by the grammar alone, finish a document
within a few hundred tokens."""

from __future__ import annotations

import random


def _value_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "boolean", "enum", "number"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "ok", "no"], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": _value_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    if kind == "object":
        names = rng.sample(["id", "name", "tags", "score", "flag", "kind", "child"], rng.randint(1, 3))
        return {"type": "object", "properties": {n: _value_schema(rng, depth + 1) for n in names}, "required": names,
                "additionalProperties": False}
    if kind == "integer":
        return {"type": "integer", "minimum": -100, "maximum": rng.randint(1, 999)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 10}
    return {"type": kind}


def top_schema(seed: int) -> dict:
    """The object schema number `seed` (the same for a seed on every run)."""
    rng = random.Random(seed)
    names = rng.sample(["user", "items", "colour", "count", "ok", "meta"], rng.randint(1, 4))
    return {"type": "object", "properties": {n: _value_schema(rng) for n in names}, "required": names,
            "additionalProperties": False}
