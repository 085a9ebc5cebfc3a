"""Run a check script under the Triton interpreter in a fresh process (triton reads TRITON_INTERPRET when
kernels are decorated, so a test process that already imported them cannot switch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
# switches that change which kernels run: the checks set what they test themselves
_KERNEL_SWITCHES = ("MSTAR_SKINNY_GEMM", "MSTAR_WAN_GEMM_GELU", "MSTAR_PDL")


def run_interpreted(script: Path, *args: str, timeout: int = 240, **env: str) -> subprocess.CompletedProcess:
    """`python3 script args...` from the repo root with TRITON_INTERPRET=1 and the repo importable;
    `env` adds variables. The caller asserts on the returned process."""
    full = {**os.environ, "TRITON_INTERPRET": "1", **env,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for name in _KERNEL_SWITCHES:
        full.pop(name, None)
    return subprocess.run([sys.executable, str(script), *args], env=full, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
