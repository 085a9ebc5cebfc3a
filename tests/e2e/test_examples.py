"""Every row of examples/README.md, against the row's model served `--tiny` in this process: each example
script runs (in-process, as `python examples/x.py ... --base-url URL` would) and each curl line runs in a
shell, and what they wrote or printed is checked for real content (tests/e2e/examples_table.py). The toy and
one LLM run by default; the other models, a second or more each, are in the slow group."""

from __future__ import annotations

import io
import runpy
import shlex
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests.e2e import examples_table as table
from tests.e2e.server_thread import running_server

pytest.importorskip("openai")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the openai client flags its videos API

FAST = ("toy", "qwen3")
MODELS = sorted({m for row in table.rows() for m in row.models})


def run_script(argv: list[str]) -> str:
    """Run an example as `python argv...` would, in this process; its stdout. A non-zero exit fails."""
    out, saved_argv = io.StringIO(), sys.argv
    sys.path.insert(0, str(table.EXAMPLES))
    sys.argv = argv
    try:
        with redirect_stdout(out):
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        assert exc.code in (None, 0), f"{shlex.join(argv)} exited with {exc.code}:\n{out.getvalue()}"
    finally:
        sys.argv = saved_argv
        sys.path.remove(str(table.EXAMPLES))
    return out.getvalue()


def check_script(row: table.Row, base: str, model: str, cwd: Path) -> None:
    before = table.snapshot(cwd)
    argv = table.script_args(row, base, model)
    printed = run_script(argv)
    written = table.outputs_of(cwd, before)
    assert printed.strip(), f"{shlex.join(argv)} printed nothing"
    if "--out" in argv:
        assert argv[argv.index("--out") + 1] in [p.name for p in written], (argv, written)
    for path in written:
        table.check_file(path)


@pytest.mark.parametrize("model", [m if m in FAST else pytest.param(m, marks=pytest.mark.slow) for m in MODELS])
def test_every_example_and_curl_line(model, tmp_path, monkeypatch):
    rows = table.rows_of(model)
    if any(row.script and row.script[0].endswith("openpi_policy.py") for row in rows):
        pytest.importorskip("openpi_client")
    monkeypatch.chdir(tmp_path)
    run_script([str(table.EXAMPLES / "common.py")])  # input.png, input.wav, input.mp4 for the curl lines
    with running_server({"model": model}, tiny=model != "toy") as base:
        for row in rows:
            if row.script:
                check_script(row, base, model, tmp_path)
            if row.curl:
                table.check_curl(row, base, tmp_path)


def test_the_table_covers_every_model_and_script():
    from mstar.models.registry import model_names

    assert set(MODELS) >= set(model_names()), set(model_names()) - set(MODELS)
    scripts = {row.script[0] for row in table.rows() if row.script}
    shipped = {f"examples/{p.name}" for p in table.EXAMPLES.glob("*.py") if p.name != "common.py"}
    assert scripts == shipped, scripts ^ shipped


def test_an_option_without_a_value_is_refused(capsys):
    """`--option KEY` without `=VALUE` is argparse's one line; it was sent as KEY="" and ignored."""
    parser = runpy.run_path(str(table.EXAMPLES / "common.py"))["parser"](None)
    assert parser.parse_args(["--option", "steps=4", "--option", "name=a=b"]).option == [("steps", 4), ("name", "a=b")]
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--option", "noequals"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--option" in err and "KEY=VALUE" in err
