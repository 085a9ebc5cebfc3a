"""What the launcher does when a worker process dies: name the cause, and restart it with backoff
until it has died too often, when the server must exit so that whoever runs it can start it afresh."""

from __future__ import annotations

import signal
import time
from collections import deque
from dataclasses import dataclass, field

RESTART_LIMIT = 5  # deaths of one rank within RESTART_WINDOW_S after which the server gives up
RESTART_WINDOW_S = 600.0
FIRST_DELAY_S = 0.5  # before the first restart; each death in the window doubles it
MAX_DELAY_S = 30.0


def exit_reason(exitcode: int | None) -> str:
    """A reaped process's exit code in words: the signal's name for a negative code."""
    if exitcode is None:
        return "stopped answering (still running)"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


@dataclass
class RestartPolicy:
    """Backoff per rank: the delay before the next restart, or None once the rank died RESTART_LIMIT
    times within RESTART_WINDOW_S."""

    limit: int = RESTART_LIMIT
    window_s: float = RESTART_WINDOW_S
    first_delay_s: float = FIRST_DELAY_S
    max_delay_s: float = MAX_DELAY_S
    _deaths: dict[int, deque[float]] = field(default_factory=dict)

    def next_delay(self, rank: int, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        deaths = self._deaths.setdefault(rank, deque())
        deaths.append(now)
        while deaths and deaths[0] < now - self.window_s:
            deaths.popleft()
        if len(deaths) >= self.limit:
            return None
        return min(self.max_delay_s, self.first_delay_s * 2 ** (len(deaths) - 1))
