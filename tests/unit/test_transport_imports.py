"""The transport layer stays model-agnostic and cheap to import."""

import ast
import subprocess
import sys
from pathlib import Path

import mstar.transport

FORBIDDEN = ("mstar.graph", "mstar.models", "mstar.engines", "mstar.conductor", "mstar.worker")


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_transport_imports_no_runtime_layer():
    files = sorted(Path(mstar.transport.__file__).parent.glob("*.py"))
    assert len(files) >= 5
    for path in files:
        bad = [m for m in _imported_modules(path) if m.startswith(FORBIDDEN)]
        assert not bad, f"{path.name} imports {bad}"


def test_importing_transport_loads_neither_torch_nor_zmq():
    code = "import sys, mstar.transport; print('torch' in sys.modules, 'zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
