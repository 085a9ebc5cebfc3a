"""The newcomer check (#44): README.md's serve install, run as written into a fresh venv, then `mstar serve`
(the default model) and tiny models started from another directory with that venv, each driven by every
example script (that venv's python, the real clients) and curl line of its rows in examples/README.md. A
dependency a route needs that the README's install leaves out fails here, not in a user's hands. SmolLM2 is
served with its real weights (the README's `mstar serve`), every other model of the table with `--tiny`
(the toy has no other flavour); Pi0.5's websocket example adds the client install examples/README.md gives."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e import examples_table as table
from tests.e2e.server_thread import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test also makes the venv
SERVED = [("smollm2", [])] + [(m, [] if m == "toy" else ["--tiny"]) for m in sorted({m for row in table.rows()
                                                                                for m in row.models} - {"smollm2"})]
CLIENT_EXTRAS = "pip install -q --no-deps openpi-client==0.1.2 && pip install -q msgpack"  # examples/README.md's


def readme_install() -> str:
    """README.md's serve command without its final `mstar serve`."""
    text = (table.ROOT / "README.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("python3 -m venv") and "'.[demo]'" in ln)
    steps = line.split(" && ")
    assert steps[-1] == "mstar serve", steps
    return " && ".join(steps[:-1])


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("newcomer") / "venv"
    install = readme_install().replace(".venv", str(path))
    client = CLIENT_EXTRAS.replace("pip ", f"{path}/bin/pip ")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    done = subprocess.run(["bash", "-c", f"{install} && {client}"], cwd=table.ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return path


def serve(venv: Path, model: str, flags: list[str], cwd: Path):
    """Start `mstar serve` from `venv` in `cwd`; (process, base URL) once it is ready."""
    port = free_port()
    argv = [str(venv / "bin" / "mstar"), "serve", *([] if model == "smollm2" else [model]), *flags, "--port",
            str(port), "--log-level", "WARNING"]
    env = {**{k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{shlex.join(argv)} exited:\n{proc.stderr.read()}"
        try:
            if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"{shlex.join(argv)} not ready after 240 s")


def run_script(venv: Path, row: table.Row, base: str, model: str, cwd: Path) -> None:
    argv = table.script_args(row, base, model)
    before = table.snapshot(cwd)
    done = subprocess.run([str(venv / "bin" / "python"), *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0 and done.stdout.strip(), f"{shlex.join(argv)}\n{done.stdout}\n{done.stderr}"
    for path in table.outputs_of(cwd, before):
        table.check_file(path)


@pytest.mark.parametrize(("model", "flags"), SERVED, ids=[m for m, _ in SERVED])
def test_readme_install_serves_every_example(venv, model, flags, tmp_path):
    python = str(venv / "bin" / "python")
    subprocess.run([python, str(table.EXAMPLES / "common.py")], cwd=tmp_path, check=True, capture_output=True)
    proc, base = serve(venv, model, flags, tmp_path)
    try:
        served = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        assert served == model, served
        for row in table.rows_of(model):
            if row.script:
                run_script(venv, row, base, model, tmp_path)
            if row.curl:
                table.check_curl(row, base, tmp_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert "Traceback" not in err, err[-4000:]
