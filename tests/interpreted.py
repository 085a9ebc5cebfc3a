"""Run a check script under the Triton interpreter in a fresh process (triton reads TRITON_INTERPRET when
kernels are decorated, so a test process that already imported them cannot switch).

Each script runs in a process forked from one helper (tests/fork_server.py) that imported torch and triton
once for the whole test session: a check pays for its own work, not for those imports again."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
# switches that change which kernels run: the checks set what they test themselves
_KERNEL_SWITCHES = ("MSTAR_SKINNY_GEMM", "MSTAR_WAN_GEMM_GELU", "MSTAR_PDL")
_server: subprocess.Popen | None = None


def _environment(extra: dict[str, str]) -> dict[str, str]:
    full = {**os.environ, "TRITON_INTERPRET": "1", **extra,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for name in _KERNEL_SWITCHES:
        full.pop(name, None)
    return full


def _fork_server() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fork_server.py")], env=_environment({}),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        atexit.register(_stop, _server)
    return _server


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.stdin.close()
        server.wait(timeout=30)


def run_interpreted(script: Path, *args: str, timeout: int = 240, **env: str) -> subprocess.CompletedProcess:
    """`python3 script args...` from the repo root with TRITON_INTERPRET=1 and the repo importable;
    `env` adds variables. The caller asserts on the returned process."""
    argv = [str(script), *args]
    server = _fork_server()
    request = {"argv": argv, "env": _environment(env), "cwd": str(ROOT), "timeout": timeout}
    try:
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        answer = json.loads(server.stdout.readline())
    except BaseException:  # interrupted mid-request (a test timeout, Ctrl-C): its answer would go to the next
        server.kill()
        server.wait()
        raise
    if answer["timed_out"]:
        raise subprocess.TimeoutExpired(argv, timeout, answer["stdout"], answer["stderr"])
    return subprocess.CompletedProcess(argv, answer["returncode"], answer["stdout"], answer["stderr"])
