"""MSTAR_STALL_DUMP_S (mstar.worker.stats.stall_dump): a step running past the limit writes every
thread's stack to stderr; one that ends in time writes nothing."""

import time

import pytest

from mstar import envs
from mstar.worker.stats import stall_dump


def test_a_step_past_the_limit_dumps_the_stacks(capfd):
    def slow_engine_step():
        time.sleep(0.5)

    with stall_dump(0.1):
        slow_engine_step()
    assert "slow_engine_step" in capfd.readouterr().err
    with stall_dump(0.1):
        pass
    time.sleep(0.4)  # the cancelled dump never comes
    assert "Thread" not in capfd.readouterr().err


def test_the_variable_takes_whole_seconds(monkeypatch):
    monkeypatch.delenv("MSTAR_STALL_DUMP_S", raising=False)
    assert envs.stall_dump_s() is None
    monkeypatch.setenv("MSTAR_STALL_DUMP_S", "30")
    assert envs.stall_dump_s() == 30
    monkeypatch.setenv("MSTAR_STALL_DUMP_S", "0")
    with pytest.raises(envs.EnvError, match="MSTAR_STALL_DUMP_S"):
        envs.stall_dump_s()
