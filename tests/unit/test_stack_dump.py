"""`kill -USR1` on a server or worker process writes its threads' stacks to stderr and it goes on."""

import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 here")


def _python(code: str) -> subprocess.CompletedProcess:
    """`code` run by a fresh interpreter, which must exit 0; its stdout and stderr."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def test_sigusr1_dumps_stacks_and_the_process_goes_on():
    code = ("import os, signal\n"
            "from mstar.runtime.process import stacks_on_sigusr1\n"
            "def waiting_here():\n"
            "    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "stacks_on_sigusr1()\n"
            "waiting_here()\n"
            "print('still running')\n")
    done = _python(code)
    assert "still running" in done.stdout
    assert "waiting_here" in done.stderr  # the frame that was running when the signal came


def test_a_server_passes_sigusr1_on_to_its_workers():
    code = ("import os, signal, subprocess, sys, time\n"
            "from mstar.runtime.process import stacks_on_sigusr1\n"
            "child = subprocess.Popen([sys.executable, '-c', 'from mstar.runtime.process import stacks_on_sigusr1\\n"
            "import sys\\nstacks_on_sigusr1()\\n"  # "ready" from inside the frame the dump must show
            "def worker_waiting():\\n    print(\"ready\", flush=True)\\n    sys.stdin.readline()\\n"
            "worker_waiting()\\n'], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
            "child.stdout.readline()\n"
            "stacks_on_sigusr1(lambda: [child.pid])\n"
            "def server_serving():\n"
            "    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "    time.sleep(0.5)\n"
            "server_serving()\n"
            "child.stdin.close()\n"  # the child waits in its frame until here, however loaded the machine
            "child.wait(timeout=30)\n")
    done = _python(code)
    assert "server_serving" in done.stderr and "worker_waiting" in done.stderr  # both wrote their stacks
