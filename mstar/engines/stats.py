"""Optional engine ability: cheap counters for /metrics (see `ReportsStats`).

Kept apart from the `Engine` protocol (mstar/engines/base.py): an engine without it still runs;
the worker then reports only its step times and batch sizes (results per step).

Keys of `stats()` the server knows (docs/metrics.md names the series they become):
    queue_depth     items submitted and not yet answered (pending work)
    kv_pages_used   KV pages held by live sequences (autoregressive)
    kv_pages_cached pages of finished sequences kept for prefix reuse; free to evict
    kv_pages_total  pages in the pool
    seqs_running    sequences holding KV pages
    seqs_waiting    sequences waiting for pages (new or preempted)
    preemptions     sequences preempted since start (a counter)
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ReportsStats(Protocol):
    """An engine that can describe its load.

    `stats()` must be cheap (no device sync, O(1) or O(live sequences)) since the worker calls it
    about twice a second; `last_step_items` is the number of items (sequences, batch rows) the
    most recent `step()` computed, 0 when it ran nothing.
    """

    last_step_items: int

    def stats(self) -> dict[str, float]: ...
