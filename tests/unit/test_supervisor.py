"""Worker supervision: exit codes in words and the restart backoff."""

from __future__ import annotations

import signal

from mstar.runtime.supervisor import RestartPolicy, exit_reason


def test_exit_reasons_name_the_signal():
    assert exit_reason(-signal.SIGKILL) == "was killed by signal SIGKILL"
    assert exit_reason(-signal.SIGSEGV) == "was killed by signal SIGSEGV"
    assert exit_reason(3) == "exited with code 3"
    assert exit_reason(None).startswith("stopped answering")


def test_backoff_doubles_within_the_window_and_gives_up_at_the_limit():
    policy = RestartPolicy(limit=4, window_s=100.0, first_delay_s=1.0, max_delay_s=3.0)
    assert [policy.next_delay(0, now=t) for t in (0, 1, 2)] == [1.0, 2.0, 3.0]  # capped at max_delay_s
    assert policy.next_delay(1, now=2) == 1.0  # ranks count apart
    assert policy.next_delay(0, now=3) is None  # the fourth death within 100 s
    fresh = RestartPolicy(limit=2, window_s=10.0, first_delay_s=1.0)
    assert fresh.next_delay(0, now=0) == 1.0
    assert fresh.next_delay(0, now=20) == 1.0  # the earlier death left the window
