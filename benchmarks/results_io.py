"""Where a benchmark's JSON goes: `--out` when given; else `benchmarks/results/<name>.json` for a real run,
and no file for a `--quick` smoke run, whose figures (tiny models on CPU) are not results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(doc: dict[str, Any], out: str | None, quick: bool, name: str) -> Path | None:
    """Write `doc` as indented JSON where the module docstring says; the path written, or None."""
    path = Path(out) if out else (None if quick else RESULTS / f"{name}.json")
    if path is not None:
        path.write_text(json.dumps(doc, indent=2) + "\n")
    return path
