"""The docs name what the code holds: the module index (docs/modules.md) is current and covers every module,
every /metrics series is in docs/metrics.md, and no config or module path in the docs is missing."""

from __future__ import annotations

import re
from pathlib import Path

from mstar.server.metrics import ServerMetrics
from mstar.transport import wire
from tools.module_index import COMMAND, INDEX, module_paths, render, undocumented

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_every_module_has_a_docstring():
    missing = undocumented()
    assert not missing, f"modules without a docstring (the module index shows its first paragraph): {missing}"


def test_module_index_covers_every_module_and_is_current():
    assert INDEX.is_file(), f"{INDEX.relative_to(ROOT)} is missing: run `{COMMAND}`"
    text = INDEX.read_text()
    missing = [p.as_posix() for p in module_paths() if p.name != "__init__.py" and f"`{p.as_posix()}`" not in text]
    assert not missing, f"docs/modules.md does not list {missing}: run `{COMMAND}` and commit docs/modules.md"
    assert text == render(), f"docs/modules.md is out of date: run `{COMMAND}` and commit docs/modules.md"


def test_paths_named_in_docs_exist():
    stale = []
    for doc in sorted(DOCS.glob("*.md")):
        for path in re.findall(r"`((?:configs|mstar|tests|benchmarks|tools)/[\w/.]+\.(?:py|yaml|json))`",
                               doc.read_text()):
            if not (ROOT / path).exists():
                stale.append(f"{doc.name}: {path}")
    assert not stale, f"paths named in docs that do not exist: {stale}"


class _Conductor:
    def stats(self) -> dict[str, int]:
        return {"in_flight": 1, "queued": 0}

    def worker_stats(self) -> dict[int, wire.WorkerStats]:
        gauges = {"queue_depth": 1.0, "kv_pages_used": 2.0, "kv_pages_cached": 1.0, "kv_pages_total": 8.0,
                  "seqs_running": 1.0, "seqs_waiting": 0.0, "preemptions": 0.0}
        steps = [1] + [0] * len(wire.STEP_SECONDS_BOUNDS)
        sizes = [1] + [0] * len(wire.BATCH_SIZE_BOUNDS)
        return {0: wire.WorkerStats(0, [wire.ComponentStats("llm", gauges, 1, 0.01, steps, 1, sizes)])}


class _Runtime:
    conductor = _Conductor()


def test_metrics_doc_lists_every_series():
    metrics = ServerMetrics(_Runtime())
    metrics.started()
    metrics.finished("stop", 200)
    metrics.http_response("/generate", 200)
    # a family's name as scraped: counters get "_total"; labelled histograms exist before any sample
    exposed = {f.name + "_total" if f.type == "counter" else f.name for f in metrics.registry.collect()}
    listed = set(re.findall(r"`(mstar_\w+)`", (DOCS / "metrics.md").read_text()))
    assert exposed - listed == set(), f"series missing from docs/metrics.md: {sorted(exposed - listed)}"
    assert listed - exposed == set(), f"docs/metrics.md lists series the server lacks: {sorted(listed - exposed)}"
