"""Who may import whom (docs/structure.md states the rules per package), checked on the source.

An AST scan of every module under mstar/ collects each import (module level and inside functions,
`import x` and `from x import y`, relative imports resolved to absolute names) and checks the rules.
The exceptions docs/structure.md records are listed below, each with its reason; anything else that
crosses a layer fails with the importing file, the line and the imported module. Nothing is imported:
the scan reads files, so it is fast and sees lazy imports too.
"""

from __future__ import annotations

import ast
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mstar"
POLICY_LAYERS = ("mstar.conductor", "mstar.server", "mstar.client", "mstar.cli")

# The engine *contracts* a model may use (docs/structure.md says the same). Everything else under
# mstar.engines is an engine internal, off limits to models.
ENGINE_CONTRACTS = (
    "mstar.engines.base",  # KVLayout and the Engine/StepItem seam a network declares itself against
    "mstar.engines.extras",  # ForwardExtras: per-step extras an AR engine hands the network
    "mstar.engines.sampling",  # SamplingParams: processors validate request options with it
    "mstar.engines.grammar",  # constrained decoding: a component sampling its own text masks its logits (BAGEL)
    "mstar.engines.cuda_graphs",  # to_device_async (pinned host copies without waiting for the GPU)
)

# What models may import from mstar: "models use graph, layers, kernels" plus the recorded exceptions.
MODELS_MAY_IMPORT = (
    "mstar.models", "mstar.graph", "mstar.layers", "mstar.kernels", *ENGINE_CONTRACTS,
    # sequence-parallel numerics a sharded network applies to its own tensors (wan22 transformer,
    # lazily); the process groups themselves (distributed.groups) are handed in, not imported
    "mstar.distributed.sequence", "mstar.distributed.ulysses",
    "mstar.envs",  # MSTAR_* accessors: a stdlib-only leaf (MSTAR_CACHE_DIR in models/common/smollm2.py)
)


@dataclass(frozen=True)
class Rule:
    """Modules under any of `importers` must not import anything under `forbidden`, except `allowed`."""

    name: str
    importers: tuple[str, ...]
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()


RULES = (
    Rule("graph imports nothing else from mstar", ("mstar.graph",), ("mstar",), allowed=("mstar.graph",)),
    Rule("transport never imports graph/models/engines/conductor/worker", ("mstar.transport",),
         ("mstar.graph", "mstar.models", "mstar.engines", "mstar.conductor", "mstar.worker")),
    Rule("conductor/server/client/cli never import engines/layers/kernels/worker", POLICY_LAYERS,
         ("mstar.engines", "mstar.layers", "mstar.kernels", "mstar.worker")),
    # models.base (the Model contract) is not "a specific model"; every model folder, common/ and
    # the registry (which loads any model) are
    Rule("engines never import transport/conductor/server or a specific model", ("mstar.engines",),
         ("mstar.transport", "mstar.conductor", "mstar.server", "mstar.models"), allowed=("mstar.models.base",)),
    Rule("models never import transport or worker", ("mstar.models",), ("mstar.transport", "mstar.worker")),
)


@dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to an absolute module name."""

    importer: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.target}"


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether module `name` is one of `prefixes` or inside one of them."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def module_name(path: Path) -> str:
    """The dotted module name of a file under mstar/."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """Whether `name` is a module or package under mstar/ (so `from pkg import name` imports it)."""
    rel = Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def imports_of(source: str, module: str, is_package: bool) -> list[Import]:
    """Every import in `source` (at any depth), targets absolute; `from m import n` counts as m.n when
    m.n is a module of ours, else as m."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(module, sub if is_module(sub) else base, node.lineno))
    return found


@functools.cache
def sources() -> dict[str, tuple[str, bool]]:
    """module name -> (source text, is a package), for every .py file under mstar/."""
    return {module_name(p): (p.read_text(), p.name == "__init__.py") for p in sorted(PACKAGE.rglob("*.py"))}


@functools.cache
def all_imports() -> tuple[Import, ...]:
    """The imports of every module under mstar/."""
    return tuple(i for mod, (src, pkg) in sources().items() for i in imports_of(src, mod, pkg))


def violations(rule: Rule) -> list[str]:
    """The imports that break `rule`."""
    return [str(i) for i in all_imports()
            if under(i.importer, rule.importers) and under(i.target, rule.forbidden)
            and not under(i.target, rule.allowed)]


def test_scan_resolves_every_import_form():
    src = (
        "import mstar.worker\n"
        "import torch as th\n"
        "from mstar.engines import sampling\n"  # a module: counts as mstar.engines.sampling
        "from mstar.graph import Walk\n"  # a name: counts as mstar.graph
        "from . import chunking\n"
        "from ..transport.wire import StartWalk\n"
        "def f():\n"
        "    from ..layers import norm\n"
    )
    got = {(i.target, i.line) for i in imports_of(src, "mstar.graph.fake", is_package=False)}
    assert got == {("mstar.worker", 1), ("torch", 2), ("mstar.engines.sampling", 3), ("mstar.graph", 4),
                   ("mstar.graph.chunking", 5), ("mstar.transport.wire", 6), ("mstar.layers.norm", 8)}
    in_package = imports_of("from .spec import Walk\n", "mstar.graph", is_package=True)
    assert [i.target for i in in_package] == ["mstar.graph.spec"]


def test_scan_covers_the_package():
    assert len(sources()) == len(list(PACKAGE.rglob("*.py"))) > 100
    # lazy (function-level) imports are seen: cli imports the runtime inside run_serve
    assert any(i.importer == "mstar.cli.main" and i.target == "mstar.runtime.launcher" for i in all_imports())


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_rule(rule: Rule):
    assert not violations(rule), f"{rule.name}, broken by:\n" + "\n".join(violations(rule))


def test_graph_imports_only_the_standard_library():
    bad = [str(i) for i in all_imports() if under(i.importer, ("mstar.graph",))
           and i.target.split(".")[0] not in sys.stdlib_module_names and not under(i.target, ("mstar.graph",))]
    assert not bad, "graph/ imports nothing but the standard library, broken by:\n" + "\n".join(bad)


def test_models_import_only_graph_layers_kernels_and_engine_contracts():
    bad = [str(i) for i in all_imports() if under(i.importer, ("mstar.models",))
           and under(i.target, ("mstar",)) and i.target != "mstar" and not under(i.target, MODELS_MAY_IMPORT)]
    assert not bad, ("models use graph, layers, kernels and the engine contracts "
                     f"{ENGINE_CONTRACTS}; broken by:\n" + "\n".join(bad))


def test_engine_contracts_exist_and_are_documented():
    structure = (ROOT / "docs" / "structure.md").read_text()
    for name in ENGINE_CONTRACTS:
        assert is_module(name), f"{name} is listed as an engine contract but does not exist"
        assert f"`{name.removeprefix('mstar.')}`" in structure, f"docs/structure.md does not name {name}"


def torch_cuda_uses(source: str) -> list[int]:
    """Lines of `source` that touch torch.cuda: importing it, or an attribute chain torch.cuda under
    any name torch is bound to."""
    tree = ast.parse(source)
    torch_names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            torch_names |= {a.asname for a in node.names if a.name == "torch" and a.asname}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(under(a.name, ("torch.cuda",)) for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module and (
                under(node.module, ("torch.cuda",)) or node.module == "torch"
                and any(a.name == "cuda" for a in node.names)):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name)
              and node.value.id in torch_names):
            lines.append(node.lineno)
    return sorted(lines)


def test_torch_cuda_finder():
    src = ("import torch as th\nimport torch.cuda\nfrom torch import cuda\nfrom torch.cuda import Stream\n"
           "def f():\n    return th.cuda.is_available()\nx = torch.device('cpu')\n")
    assert torch_cuda_uses(src) == [2, 3, 4, 6]


def test_policy_layers_never_touch_torch_cuda():
    bad = [f"{mod}:{line}" for mod, (src, _) in sources().items() if under(mod, POLICY_LAYERS)
           for line in torch_cuda_uses(src)]
    assert not bad, "conductor/server/client/cli never touch torch.cuda, broken at: " + ", ".join(bad)
