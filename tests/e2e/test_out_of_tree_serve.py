"""`mstar serve my_models:ShoutingToy`, run next to `my_models.py` with nothing installed: it starts, its
banner quotes the name the server answers to (the class's, not the spec), and a chat request is answered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.e2e.server_thread import free_port

MODULE = '''
from mstar.models.toy.model import ToyModel


class ShoutingToy(ToyModel):
    name = "shouting_toy"
'''


def test_a_module_class_spec_serves_from_the_working_directory(tmp_path):
    (tmp_path / "my_models.py").write_text(MODULE)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the console script, not `python -m`, which would put the working directory on sys.path itself
    mstar = Path(sys.executable).parent / "mstar"
    proc = subprocess.Popen([str(mstar), "serve", "my_models:ShoutingToy", "--port", str(port), "--log-level",
                             "WARNING"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"] == "shouting_toy"
        resp = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": "shouting_toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "mstar is serving 'shouting_toy'" in err, err
