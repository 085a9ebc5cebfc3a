"""An in-process worker builds its engines on its own thread, and a build error reaches the caller."""

import threading

import pytest

from mstar.runtime import launcher
from mstar.runtime.offline import MStar


def test_engines_are_built_on_the_worker_thread(monkeypatch):
    build, threads = launcher.build_engines, []

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return build(*args, **kwargs)

    monkeypatch.setattr(launcher, "build_engines", recording)
    with MStar("toy") as m:
        assert m.generate({"text": "hi"}, max_tokens=2).outputs
    assert threads == ["mstar-worker-0"]


def test_a_build_error_is_raised_by_the_runtime(monkeypatch):
    def failing(*args, **kwargs):
        raise RuntimeError("no engine today")

    monkeypatch.setattr(launcher, "build_engines", failing)
    with pytest.raises(RuntimeError, match="no engine today"):
        MStar("toy")
