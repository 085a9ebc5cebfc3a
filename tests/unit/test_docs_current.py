"""The docs name what the code holds: every module in docs/structure.md, every /metrics series in
docs/metrics.md, and no config or module path in the docs that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

from mstar.server.metrics import ServerMetrics
from mstar.transport import wire

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_structure_names_every_module():
    text = (DOCS / "structure.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "mstar").rglob("*.py"))
               if p.name != "__init__.py" and f"`{p.name}`" not in text]
    assert not missing, f"docs/structure.md does not name: {missing}"


def test_paths_named_in_docs_exist():
    stale = []
    for doc in sorted(DOCS.glob("*.md")):
        for path in re.findall(r"`((?:configs|mstar|tests|benchmarks)/[\w/.]+\.(?:py|yaml|json))`", doc.read_text()):
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
