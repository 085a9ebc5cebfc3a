"""The command lines in README.md, docs/*.md and docs/models/*.md run as written: each benchmark script they name
exists, each `--flag` given to it is one its argparse defines (read from its source, so no torch is imported),
each `gpu_suite.sh STEP` is a step the suite handles, and `mstar serve` / `mstar bench` take the flags shown.

A table row that records a run made with a flag deleted since may keep the command as it ran only by saying so
in the same row, naming the flag: "`--flag` no longer exists".
"""

from __future__ import annotations

import argparse
import ast
import re
from functools import cache
from pathlib import Path

from mstar.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs/models").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SCRIPT = re.compile(r"(\S*/)?(\w+)\.py")
GONE = "`{}` no longer exists"


def _code(text: str):
    """(line number, that line, code) for each line of a shell or indented block and each inline code span,
    whitespace collapsed (a span may wrap over lines)."""
    lines = text.splitlines()
    for fence in FENCE.finditer(text):
        if fence.group(1) in ("bash", "sh", ""):
            first = text.count("\n", 0, fence.start(2))
            for i, code in enumerate(fence.group(2).splitlines()):
                yield first + i + 1, lines[first + i], code
    # blank the fenced blocks out, keeping their newlines, so their backticks pair with nothing and line numbers hold
    rest = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    block, previous = False, ""
    for i, line in enumerate(rest.splitlines()):  # an indented block: lines of 4 spaces or more after a blank line
        block = bool(line.startswith("    ") and line.strip()) and (block or not previous.strip())
        previous = line
        if block:
            yield i + 1, line, line.strip()
    for span in re.finditer(r"`([^`]+)`", rest):
        n = rest.count("\n", 0, span.start())
        yield n + 1, lines[n], " ".join(span.group(1).split())


def _commands(text: str):
    """(line number, line, program, words after it) for each benchmark script, gpu_suite.sh and mstar serve /
    bench call in the text; program is "benchmarks/X.py", "gpu_suite.sh", "mstar serve" or "mstar bench"."""
    for n, line, code in _code(text):
        for part in re.split(r"&&|;|\|", code):
            words = part.split()
            words = words[:next((i for i, w in enumerate(words) if w.startswith("#")), len(words))]
            for i, word in enumerate(words):
                script = SCRIPT.fullmatch(word)
                # a bare X.py counts when arguments follow; a path counts only under benchmarks/
                folder = script and script.group(1)
                if script and (folder.endswith("benchmarks/") if folder else len(words) > i + 1):
                    yield n, line, f"benchmarks/{script.group(2)}.py", words[i + 1:]
                    break
                if word.endswith("gpu_suite.sh"):
                    yield n, line, "gpu_suite.sh", words[i + 1:]
                    break
                if word in ("mstar", "mstar.cli.main") and words[i + 1:i + 2] in (["serve"], ["bench"]):
                    yield n, line, f"mstar {words[i + 1]}", words[i + 2:]
                    break


def _flags(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if w.startswith("--") and len(w) > 2]


@cache
def script_flags(path: Path) -> frozenset[str]:
    """The option strings of every add_argument call in a script's source whose names are literals."""
    flags = set()
    for call in ast.walk(ast.parse(path.read_text())):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument":
            names = [a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
            flags.update(names)
            action = next((k.value for k in call.keywords if k.arg == "action"), None)
            if isinstance(action, ast.Attribute) and action.attr == "BooleanOptionalAction":
                flags.update("--no-" + name[2:] for name in names if name.startswith("--"))
    return frozenset(flags)


def suite_steps() -> set[str]:
    return set(re.findall(r"\$WHAT == (\w+)", (BENCH / "gpu_suite.sh").read_text()))


def cli_flags() -> dict[str, set[str]]:
    """Each `mstar` subcommand's option strings, from the parser `mstar` itself builds (it starts nothing)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {f"mstar {name}": {o for a in p._actions for o in a.option_strings} for name, p in sub.choices.items()}


def mismatches(text: str, where: str) -> list[str]:
    """What in `text` names a missing script, a flag its program lacks, or a suite step that does not exist."""
    steps, cli = suite_steps(), cli_flags()
    found = []
    for n, line, program, words in _commands(text):
        at = f"{where}:{n}: {program}"
        if program == "gpu_suite.sh":
            step = words[0] if words else "all"
            if re.fullmatch(r"\w+", step) and step not in steps:
                found.append(f"{at}: no step {step!r} in benchmarks/gpu_suite.sh")
            continue
        if program in cli:
            known = cli[program]
        elif (ROOT / program).is_file():
            known = script_flags(ROOT / program)
        else:
            found.append(f"{at}: no such script")
            continue
        marked = line.startswith("|")  # only a table row of a past run may name a deleted flag
        for flag in _flags(words):
            gone = marked and GONE.format(flag) in line
            if flag not in known and not gone:
                found.append(f"{at}: {flag} is not one of its flags")
            elif flag in known and gone:
                found.append(f"{at}: the row says {flag} no longer exists, and it has it")
    return found


def test_doc_commands_match_the_scripts_and_cli():
    found = [m for doc in DOC_FILES for m in mismatches(doc.read_text(), doc.relative_to(ROOT).as_posix())]
    assert not found, "doc commands that do not run as written:\n" + "\n".join(found)


def test_the_docs_name_commands_of_every_kind():
    # the extraction itself must keep finding commands, or the test above would pass on nothing
    programs = [p for doc in DOC_FILES for _, _, p, _ in _commands(doc.read_text())]
    assert {"gpu_suite.sh", "mstar serve", "mstar bench"} <= set(programs)
    assert sum(p.startswith("benchmarks/") for p in programs) > 50


def test_a_renamed_flag_a_missing_script_or_step_and_a_stale_mark_are_found():
    table = "| metric | `vjepa2_bench.py --horizons-list 4` |\n"
    assert mismatches(table, "t") == ["t:1: benchmarks/vjepa2_bench.py: --horizons-list is not one of its flags"]
    assert mismatches(table[:-2] + " `--horizons-list` no longer exists |", "t") == []
    # the mark covers only the flag it names, only in a table row, and only while the flag is gone
    row = "| `vjepa2_bench.py --horizons-list 4 --frame 2` (`--horizons-list` no longer exists) |"
    assert mismatches(row, "t") == ["t:1: benchmarks/vjepa2_bench.py: --frame is not one of its flags"]
    assert len(mismatches(row.strip("|"), "t")) == 2
    assert mismatches("| `vjepa2_bench.py --horizons 4` (`--horizons` no longer exists) |", "t") == [
        "t:1: benchmarks/vjepa2_bench.py: the row says --horizons no longer exists, and it has it"]
    assert mismatches("`nope_bench.py --x 1`", "t") == ["t:1: benchmarks/nope_bench.py: no such script"]
    assert mismatches("```bash\nOUT=o bash benchmarks/gpu_suite.sh nope\n```\n", "t") == [
        "t:2: gpu_suite.sh: no step 'nope' in benchmarks/gpu_suite.sh"]
    assert mismatches("`mstar serve toy --tiny --ports 1` and `mstar bench --ouput x`", "t") == [
        "t:1: mstar serve: --ports is not one of its flags", "t:1: mstar bench: --ouput is not one of its flags"]


def test_gpu_suite_calls_take_their_flags():
    # the suite's own calls of the same scripts and of mstar serve / bench, continuation lines joined
    suite = "```bash\n" + (BENCH / "gpu_suite.sh").read_text().replace("\\\n", " ") + "\n```\n"
    assert len(list(_commands(suite))) > 30
    found = mismatches(suite, "benchmarks/gpu_suite.sh (continuations joined)")
    assert not found, "gpu_suite.sh calls that do not run as written:\n" + "\n".join(found)
