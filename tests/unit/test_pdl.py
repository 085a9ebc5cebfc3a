"""Programmatic Dependent Launch (mstar/kernels/pdl.py): which devices get it, and the contract every
PDL-launched kernel keeps, checked on the kernels' source (the GPU behaviour is in tests/gpu/test_pdl_gpu.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from mstar import envs
from tests.interpreted import run_interpreted

pytest.importorskip("triton")

from mstar.kernels import pdl  # noqa: E402

KERNELS_DIR = Path(__file__).parents[2] / "mstar" / "kernels"
CUDA0 = torch.device("cuda", 0)  # a descriptor only: no GPU is touched (capability is faked)


@pytest.fixture
def make_switch(monkeypatch):
    """A fresh _PdlSwitch built under a given MSTAR_PDL, with a faked GPU capability and Triton support."""
    reads = []

    def make(env: str | None, capability=(9, 0), triton_ok: bool = True, interpret: bool = False):
        if env is None:
            monkeypatch.delenv("MSTAR_PDL", raising=False)
        else:
            monkeypatch.setenv("MSTAR_PDL", env)
        if interpret:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        else:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)

        def capability_of(index=None):
            reads.append(index)
            return capability

        monkeypatch.setattr(torch.cuda, "get_device_capability", capability_of)
        monkeypatch.setattr(pdl, "triton_supports_pdl", lambda: triton_ok)
        return pdl._PdlSwitch()

    make.reads = reads
    return make


@pytest.mark.parametrize("env, capability, triton_ok, expected", [
    (None, (9, 0), True, True),  # auto: Hopper
    ("auto", (10, 0), True, True),  # auto: Blackwell
    ("AUTO", (8, 9), True, False),  # auto: Ada has no griddepcontrol
    (None, (9, 0), False, False),  # auto: a Triton without launch_pdl
    ("0", (9, 0), True, False),
    ("1", (9, 0), True, True),
])
def test_switch_on_cuda(make_switch, env, capability, triton_ok, expected):
    switch = make_switch(env, capability, triton_ok)
    assert switch.enabled(CUDA0) is expected
    assert switch.launch(CUDA0) == ({"PDL": True, "launch_pdl": True} if expected else {"PDL": False})


@pytest.mark.parametrize("env", [None, "auto", "1"])
def test_never_on_cpu_or_under_the_interpreter(make_switch, env):
    assert make_switch(env).enabled(torch.device("cpu")) is False
    assert make_switch(env, interpret=True).enabled(CUDA0) is False  # the interpreter has no gdc_* ops


@pytest.mark.parametrize("capability, triton_ok", [((8, 0), True), ((9, 0), False)])
def test_forced_on_where_impossible_raises(make_switch, capability, triton_ok):
    switch = make_switch("1", capability, triton_ok)
    with pytest.raises(RuntimeError, match="MSTAR_PDL=1"):
        switch.enabled(CUDA0)


@pytest.mark.parametrize("value", ["2", "yes", "on"])
def test_bad_value_raises_env_error(make_switch, value):
    with pytest.raises(envs.EnvError, match=f"MSTAR_PDL='{value}'.*0, 1, auto"):
        make_switch(value)


def test_tests_can_flip_the_mode_and_support_is_read_once_per_device(make_switch):
    switch = make_switch(None)
    assert switch.enabled(CUDA0) and switch.enabled(CUDA0)
    switch.mode = False
    assert not switch.enabled(CUDA0)
    switch.mode = True
    assert switch.enabled(CUDA0) and switch.enabled(torch.device("cuda", 1))
    assert make_switch.reads == [0, 1]


def test_module_switch_serves_the_launchers(monkeypatch):
    monkeypatch.setattr(pdl.PDL, "mode", True)
    assert pdl.pdl_args(torch.device("cpu")) == {"PDL": False}


def test_installed_triton_supports_pdl():
    import triton

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 4):
        pytest.skip(f"Triton {triton.__version__} predates launch_pdl")
    assert pdl.triton_supports_pdl()


# --- the contract on the kernels' source -----------------------------------------------------------------

# Every kernel launched in a decode step (and prefill) -> its module; each must keep the PDL contract.
PDL_KERNELS = {
    "gemv.py": ("_gemv_kernel",),
    "skinny_gemm.py": ("_skinny_kernel", "_splitk_reduce_kernel"),
    "decode_attention.py": ("_decode_kernel", "_reduce_kernel"),
    "fused_ops.py": ("_rms_norm_kernel", "_rotary_kernel", "_rope_cos_sin_kernel", "_qk_norm_rotary_kernel",
                     "_act_mul_kernel", "_sigmoid_gate_add_kernel", "_pair_rows_kernel"),
    "kv_store.py": ("_store_kv_kernel",),
    "moe_small.py": ("_gate_up_kernel", "_down_kernel"),
    "prefill_attention.py": ("_prefill_kernel",),
    "../models/qwen3_omni/step_attention.py": ("_step_attention_kernel",),  # model-only kernels live with it
    "../models/qwen3_omni/small_vocab_sampling.py": ("_sample_kernel",),
    "window_head.py": ("_window_head_kernel",),
}
WEIGHT_POINTERS = {"w_ptr", "w_ptrs"}  # constant during a step: what a kernel may read before the wait
# ... and what else some kernels may (mstar/kernels/pdl.py, rule 1): the decode attention's lengths and
# block tables (copied in before the step's kernels) and cached keys/values of earlier steps
EARLY_READS = {"_decode_kernel": WEIGHT_POINTERS | {"seq_lens_ptr", "block_tables_ptr", "k_cache_ptr", "v_cache_ptr"}}
# helpers that may run before the wait: loads of weight tiles or cached blocks (their pointers checked),
# and an earlier wait
PRE_WAIT_HELPERS = {"pdl_launch_dependents", "pdl_wait", "load_chunk", "_load_block"}


def _is_call_to(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def _pointers(expr: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and n.id.endswith(("_ptr", "_ptrs"))}


def contract_errors(kernel: ast.FunctionDef) -> list[str]:
    """What breaks the PDL contract in one kernel: see mstar/kernels/pdl.py."""
    name = kernel.name
    if "PDL" not in [a.arg for a in kernel.args.args]:
        return [f"{name}: no PDL parameter"]
    body = kernel.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    errors = []
    if not (isinstance(body[0], ast.Expr) and _is_call_to(body[0].value, "pdl_launch_dependents")):
        errors.append(f"{name}: pdl_launch_dependents(PDL) is not its first statement")
    allowed = EARLY_READS.get(name, WEIGHT_POINTERS)
    waits = [i for i, stmt in enumerate(body) if isinstance(stmt, ast.Expr) and _is_call_to(stmt.value, "pdl_wait")]
    if not waits:
        return errors + [f"{name}: no pdl_wait(PDL) at the top level of its body"]
    for stmt in body[:waits[0]]:
        for node in ast.walk(stmt):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "tl":
                if func.attr == "store" or func.attr.startswith("atomic"):
                    errors.append(f"{name}: tl.{func.attr} before pdl_wait")
                elif func.attr == "load" and not _pointers(node.args[0]) <= allowed:
                    errors.append(f"{name}: loads {sorted(_pointers(node.args[0]))} before pdl_wait")
            elif isinstance(func, ast.Name) and func.id not in PRE_WAIT_HELPERS:
                errors.append(f"{name}: calls {func.id} before pdl_wait")
            elif (_is_call_to(node, "load_chunk") or _is_call_to(node, "_load_block")) and \
                    not set().union(*map(_pointers, node.args)) <= allowed:
                errors.append(f"{name}: {func.id} of {sorted(set().union(*map(_pointers, node.args)))} before pdl_wait")
    return errors


def _kernels(source: str) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")}


def _launches_without_pdl_args(source: str) -> list[str]:
    """Kernel launches `k[grid](...)` in functions that never call pdl_args."""
    bad = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, ast.FunctionDef):
            continue
        calls = [n for n in ast.walk(func) if isinstance(n, ast.Call)]
        has_args = any(_is_call_to(c, "pdl_args") for c in calls)
        for call in calls:
            target = call.func
            if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and not has_args:
                bad.append(f"{func.name} launches {target.value.id}")
    return bad


@pytest.mark.parametrize("module", sorted(PDL_KERNELS))
def test_every_decode_kernel_keeps_the_pdl_contract(module):
    source = (KERNELS_DIR / module).read_text()
    kernels = _kernels(source)
    assert set(kernels) == set(PDL_KERNELS[module]), "a new kernel: give it the PDL contract and list it here"
    errors = [e for name in PDL_KERNELS[module] for e in contract_errors(kernels[name])]
    assert not errors, errors
    assert not _launches_without_pdl_args(source)


def test_contract_checker_catches_violations():
    good = '''
def k_kernel(x_ptr, w_ptr, out_ptr, PDL: tl.constexpr):
    """doc"""
    pdl_launch_dependents(PDL)
    w = tl.load(w_ptr + 1)
    w2 = load_chunk(w_ptr, 0, None, True)
    pdl_wait(PDL)
    tl.store(out_ptr, tl.load(x_ptr) * w)
'''
    assert contract_errors(_kernels(good)["k_kernel"]) == []
    cases = {
        "tl.store before": good.replace("    pdl_wait(PDL)\n", "    tl.store(out_ptr, w)\n    pdl_wait(PDL)\n"),
        "loads ['x_ptr']": good.replace("tl.load(w_ptr + 1)", "tl.load(x_ptr + 1)"),
        "load_chunk of ['x_ptr']": good.replace("load_chunk(w_ptr,", "load_chunk(x_ptr,"),
        "tl.atomic_add before": good.replace("    pdl_wait(PDL)\n", "    tl.atomic_add(out_ptr, 1)\n    pdl_wait(PDL)\n"),
        "calls helper before": good.replace("    pdl_wait(PDL)\n", "    helper(x_ptr)\n    pdl_wait(PDL)\n"),
        "no pdl_wait": good.replace("    pdl_wait(PDL)\n", "    if PDL:\n        pdl_wait(PDL)\n"),
        "not its first statement": good.replace("    pdl_launch_dependents(PDL)\n", ""),
        "no PDL parameter": good.replace(", PDL: tl.constexpr", ""),
    }
    for expected, source in cases.items():
        errors = contract_errors(_kernels(source)["k_kernel"])
        assert any(expected in e for e in errors), (expected, errors)
    # the decode attention may read lengths, tables and cached blocks early; no other kernel may
    early = good.replace("w = tl.load(w_ptr + 1)", "w = tl.load(seq_lens_ptr + 1)").replace(
        "w2 = load_chunk(w_ptr, 0, None, True)", "k, v, m = _load_block(k_cache_ptr, v_cache_ptr, block_tables_ptr, 0)")
    assert contract_errors(_kernels(early.replace("k_kernel", "_decode_kernel"))["_decode_kernel"]) == []
    errors = contract_errors(_kernels(early)["k_kernel"])
    assert any("loads ['seq_lens_ptr']" in e for e in errors) and any("_load_block of" in e for e in errors), errors
    wrong = early.replace("_load_block(k_cache_ptr", "_load_block(q_ptr").replace("k_kernel", "_decode_kernel")
    assert any("_load_block of" in e and "q_ptr" in e for e in contract_errors(_kernels(wrong)["_decode_kernel"]))
    launcher = "def f(x):\n    k_kernel[(1,)](x, PDL=False)\n"
    assert _launches_without_pdl_args(launcher) == ["f launches k_kernel"]
    assert _launches_without_pdl_args(launcher.replace("PDL=False", "**pdl_args(x.device)")) == []


def test_kernels_forced_on_still_run_interpreted_with_the_same_bits():
    proc = run_interpreted(Path(__file__).with_name("pdl_check.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pdl interpreted ok" in proc.stdout
