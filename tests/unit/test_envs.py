"""mstar/envs.py: typed accessors, defaults, clear errors, the docs table, and no direct reads elsewhere."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from mstar import envs

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "mstar"
NAME_RE = re.compile(r"MSTAR_[A-Z0-9_]+")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in envs.ALL:
        monkeypatch.delenv(var.name, raising=False)


def test_defaults_when_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert envs.fused_kernels() is True
    assert envs.skinny_gemm() is None
    assert envs.pdl() is None
    assert envs.cache_dir() == tmp_path / ".cache" / "mstar"
    assert envs.api_key() is None
    assert envs.session() is None
    assert envs.bench_profile_dir() is None
    assert envs.schemathesis_examples() == 25


def test_empty_value_counts_as_unset(monkeypatch):
    for var in envs.ALL:
        monkeypatch.setenv(var.name, "")
    assert envs.fused_kernels() is True
    assert envs.skinny_gemm() is None
    assert envs.pdl() is None
    assert envs.api_key() is None
    assert envs.session() is None
    assert envs.schemathesis_examples() == 25


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True), ("false", False), ("TRUE", True)])
def test_fused_kernels_flag(monkeypatch, value, expected):
    monkeypatch.setenv("MSTAR_FUSED_KERNELS", value)
    assert envs.fused_kernels() is expected


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True), ("auto", None), ("Auto", None)])
def test_skinny_gemm_tristate(monkeypatch, value, expected):
    monkeypatch.setenv("MSTAR_SKINNY_GEMM", value)
    assert envs.skinny_gemm() is expected


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True), ("auto", None), (" AUTO ", None)])
def test_pdl_tristate(monkeypatch, value, expected):
    monkeypatch.setenv("MSTAR_PDL", value)
    assert envs.pdl() is expected


def test_typed_values_read_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MSTAR_CACHE_DIR", "~/ckpt")
    monkeypatch.setenv("MSTAR_API_KEY", "s3cret")
    monkeypatch.setenv("MSTAR_SESSION", "abc_1")
    monkeypatch.setenv("MSTAR_BENCH_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("MSTAR_SCHEMATHESIS_EXAMPLES", "7")
    assert envs.cache_dir() == tmp_path / "ckpt"
    assert envs.api_key() == "s3cret"
    assert envs.session() == "abc_1"
    assert envs.bench_profile_dir() == tmp_path
    assert envs.schemathesis_examples() == 7
    monkeypatch.setenv("MSTAR_SCHEMATHESIS_EXAMPLES", "9")
    assert envs.schemathesis_examples() == 9


@pytest.mark.parametrize("name, value, accessor, accepted", [
    ("MSTAR_FUSED_KERNELS", "yes", envs.fused_kernels, "1, true, 0, false"),
    ("MSTAR_SKINNY_GEMM", "2", envs.skinny_gemm, "0, 1, auto"),
    ("MSTAR_PDL", "true", envs.pdl, "0, 1, auto"),
    ("MSTAR_SCHEMATHESIS_EXAMPLES", "many", envs.schemathesis_examples, "a whole number >= 1"),
    ("MSTAR_SCHEMATHESIS_EXAMPLES", "0", envs.schemathesis_examples, "a whole number >= 1"),
])
def test_bad_value_names_variable_and_accepted_values(monkeypatch, name, value, accessor, accepted):
    monkeypatch.setenv(name, value)
    with pytest.raises(envs.EnvError) as info:
        accessor()
    message = str(info.value)
    assert f"{name}={value!r}" in message
    assert accepted in message
    assert isinstance(info.value, ValueError)


def test_call_sites_use_the_accessors(monkeypatch):
    from mstar.cli.main import build_parser, read_api_key
    from mstar.layers.fused import _Switch
    from mstar.layers.linear import _SkinnySwitch
    from mstar.transport.tensors import session_id

    monkeypatch.setenv("MSTAR_FUSED_KERNELS", "0")
    monkeypatch.setenv("MSTAR_SKINNY_GEMM", "1")
    monkeypatch.setenv("MSTAR_API_KEY", "k")
    monkeypatch.setenv("MSTAR_SESSION", "run_42")
    assert _Switch().enabled is False
    assert _SkinnySwitch().force is True
    assert read_api_key(build_parser().parse_args(["serve"])) == "k"
    assert session_id() == "run_42"
    monkeypatch.setenv("MSTAR_SESSION", "bad-id")
    with pytest.raises(ValueError, match="set MSTAR_SESSION or pass session="):
        session_id()


def test_specs_are_unique_and_prefixed():
    names = [var.name for var in envs.ALL]
    assert len(set(names)) == len(names)
    assert all(NAME_RE.fullmatch(name) for name in names)


def test_docs_table_matches_describe():
    text = (ROOT / "docs" / "structure.md").read_text()
    found = re.search(r"<!-- envs:begin -->\n(.*?)<!-- envs:end -->", text, re.S)
    assert found, "docs/structure.md lacks the <!-- envs:begin --> ... <!-- envs:end --> block"
    assert found.group(1) == envs.describe(), (
        "docs/structure.md is out of date: paste mstar.envs.describe() between the envs markers")
    for var in envs.ALL:
        assert f"| `{var.name}` |" in envs.describe()


def test_envs_imports_only_the_standard_library():
    tree = ast.parse((PACKAGE / "envs.py").read_text())
    modules = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    modules |= {node.module.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module}
    assert modules <= set(sys.stdlib_module_names) | {"__future__"}, modules


def _docstring_ids(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def direct_names(source: str) -> list[str]:
    """MSTAR_* names a module spells as string literals in code (docstrings excepted)."""
    tree = ast.parse(source)
    docstrings = _docstring_ids(tree)
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and NAME_RE.fullmatch(node.value)]


def test_checker_catches_direct_reads():
    assert direct_names('import os\nx = os.environ.get("MSTAR_X", "1")\n') == ["MSTAR_X"]
    assert direct_names('import os\nos.environ["MSTAR_Y"] = "s"\n') == ["MSTAR_Y"]
    assert direct_names('"""Set MSTAR_X."""\nhelp = "env MSTAR_X"\n') == []


def test_no_module_but_envs_names_an_mstar_variable():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "envs.py":
            continue
        names = direct_names(path.read_text())
        if names:
            offenders[str(path.relative_to(ROOT))] = names
    assert not offenders, f"read these through mstar/envs.py: {offenders}"


def test_every_mentioned_variable_is_documented():
    known = {var.name for var in envs.ALL}
    mentioned = set()
    for folder in ("mstar", "benchmarks", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if path != Path(__file__):  # this file names made-up variables to test the checker
                mentioned |= set(NAME_RE.findall(path.read_text()))
    assert mentioned <= known, f"add to mstar/envs.py: {sorted(mentioned - known)}"
