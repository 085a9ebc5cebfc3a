"""Where a benchmark's JSON goes: `--out` when given; else `benchmarks/results/<name>.json` for a real run,
and no file for a `--quick` smoke run, whose figures (tiny models on CPU) are not results."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def gpu_tag(name: str) -> str:
    """h100, h200, ... from a CUDA device name: the GPU kind result files are named by (as gpu_suite.sh names
    them), "gpu" for a kind not listed."""
    found = re.search(r"h100|h200|b200|a100", name.lower())
    return found.group(0) if found else "gpu"


def write_results(doc: dict[str, Any], out: str | None, quick: bool, name: str) -> Path | None:
    """Write `doc` as indented JSON where the module docstring says; the path written, or None."""
    path = Path(out) if out else (None if quick else RESULTS / f"{name}.json")
    if path is not None:
        path.write_text(json.dumps(doc, indent=2) + "\n")
    return path
