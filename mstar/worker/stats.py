"""A worker's engine statistics: step-time and batch-size histograms plus engine gauges.

The loop records each engine step (two `perf_counter` reads and two bisects); about twice a second
the worker builds one `WorkerStats` message and sends it to the conductor only if it differs from
the last one sent, so an idle worker sends nothing. A worker that turns busy or idle also sends at
once (at most every `MIN_GAP_S`): otherwise a burst shorter than the interval would never show, and
/metrics would read idle, with no steps counted, while the burst ran and just after it.

`stall_dump` (MSTAR_STALL_DUMP_S) watches a step's time the other way: one that runs too long writes
every thread's stack.
"""

from __future__ import annotations

import faulthandler
import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from mstar.transport import wire

logger = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.5
MIN_GAP_S = 0.05  # between two sends, so a worker that flips busy/idle every step is not chatty


class StepHistograms:
    """Cumulative step counts of one component, bucketed by duration and by items per step."""

    __slots__ = ("steps", "seconds_sum", "seconds_buckets", "items_sum", "size_buckets")

    def __init__(self) -> None:
        self.steps = 0
        self.seconds_sum = 0.0
        self.seconds_buckets = [0] * (len(wire.STEP_SECONDS_BOUNDS) + 1)
        self.items_sum = 0
        self.size_buckets = [0] * (len(wire.BATCH_SIZE_BOUNDS) + 1)

    def record(self, seconds: float, items: int) -> None:
        """Count one step that ran `items` items in `seconds`."""
        self.steps += 1
        self.seconds_sum += seconds
        # bisect_left finds the first bound >= value: Prometheus buckets are "less or equal".
        self.seconds_buckets[bisect_left(wire.STEP_SECONDS_BOUNDS, seconds)] += 1
        self.items_sum += items
        self.size_buckets[bisect_left(wire.BATCH_SIZE_BOUNDS, items)] += 1


class StatsReporter:
    """Aggregates the step timings of one worker's engines and sends `WorkerStats` when changed.

    `send(msg)` delivers to the conductor; it is called from the worker's own thread only.
    """

    def __init__(self, rank: int, engines: Mapping[str, Any], send: Callable[[wire.WorkerStats], None],
                 interval_s: float = STATS_INTERVAL_S) -> None:
        self.rank = rank
        self.engines = engines
        self.interval_s = interval_s
        self._send = send
        self._hist = {name: StepHistograms() for name in engines}
        self._last_sent: wire.WorkerStats | None = None
        self._next_check = 0.0  # perf_counter time of the next snapshot; 0: the first call sends
        self._sent_at = float("-inf")  # perf_counter time of the last send
        self._sent_busy = False  # whether the worker was busy when the last snapshot was sent

    def record(self, component: str, seconds: float, items: int) -> None:
        """Count one engine step; steps that ran nothing are not counted."""
        if items > 0:
            self._hist[component].record(seconds, items)

    def maybe_send(self, busy: bool = False) -> bool:
        """Send a snapshot if it differs from the last one and either `interval_s` has passed or the
        worker turned busy or idle (`busy`: some engine has work) at least `MIN_GAP_S` after the last
        send; True if sent."""
        now = time.perf_counter()
        turned = busy != self._sent_busy and now >= self._sent_at + MIN_GAP_S
        if now < self._next_check and not turned:
            return False
        self._next_check = now + self.interval_s
        snapshot = self.snapshot()
        if snapshot == self._last_sent:
            self._sent_busy = busy  # nothing to tell: the state it would report is already known
            return False
        try:
            self._send(snapshot)
        except Exception:  # metrics must never stop the worker; the next change retries
            logger.warning("worker %d could not send its stats", self.rank, exc_info=True)
            return False
        self._last_sent, self._sent_at, self._sent_busy = snapshot, now, busy
        return True

    def snapshot(self) -> wire.WorkerStats:
        """The current WorkerStats of this worker (engines' gauges read now)."""
        components = []
        for name, engine in self.engines.items():
            gauges = {k: float(v) for k, v in engine.stats().items()}
            h = self._hist[name]
            components.append(wire.ComponentStats(name, gauges, h.steps, h.seconds_sum, list(h.seconds_buckets),
                                                  h.items_sum, list(h.size_buckets)))
        return wire.WorkerStats(self.rank, components)


@contextmanager
def stall_dump(seconds: float) -> Iterator[None]:
    """If the block runs longer than `seconds`, every thread's stack goes to stderr (once), from
    faulthandler's own thread: it works while this one is blocked in C (a GPU wait). faulthandler keeps
    one such timer per process: with several in-process workers one's step may cancel another's."""
    faulthandler.dump_traceback_later(seconds, repeat=False, exit=False)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
