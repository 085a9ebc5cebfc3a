"""A helper process for tests/interpreted.py: imports torch and triton once, then runs each requested check
script in a process forked from itself, so every check starts fresh (its kernels decorated under the
environment it asks for) without paying for those imports again.

Protocol: one JSON request a line on stdin, {"argv", "env", "cwd", "timeout"}; one JSON answer a line on
the original stdout, {"returncode", "stdout", "stderr", "timed_out"}. It ends when stdin closes.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback

import torch
import triton  # noqa: F401  (imported once here; kernels are decorated in each fork)


def _child(request: dict, out_path: str, err_path: str) -> None:
    """Become `python argv...` with the request's environment and working directory; never returns."""
    code = 1
    try:
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out_path, os.O_WRONLY), (2, err_path, os.O_WRONLY)):
            target = os.open(path, flags)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115  (lives until os._exit)
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(request["env"])
        if "OMP_NUM_THREADS" in request["env"]:  # read when torch loaded, before the fork
            torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
        os.chdir(request["cwd"])
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float) -> tuple[int, bool]:
    """(return code as subprocess reports it, timed out) of the forked child `pid`."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status), True
        time.sleep(0.005)


def _run(request: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        for path in (out_path, err_path):
            open(path, "w").close()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, out_path, err_path)
        returncode, timed_out = _wait(pid, request["timeout"])
        with open(out_path, errors="replace") as out, open(err_path, errors="replace") as err:
            return {"returncode": returncode, "stdout": out.read(), "stderr": err.read(), "timed_out": timed_out}


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed here outside the protocol goes to stderr
    for line in sys.stdin:
        answers.write(json.dumps(_run(json.loads(line))) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
