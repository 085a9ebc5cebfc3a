"""Every MSTAR_* environment variable: its name, type, default and meaning, in one place.

Each variable has an `EnvVar` spec (what `describe()` lists for the docs) and one typed accessor
function that reads `os.environ` when called, never at import, so tests can monkeypatch the
environment. An empty value counts as unset. A value outside what a variable accepts raises
`EnvError`, naming the variable, the value and the accepted values. Callers that must read a
variable once per process (the kernel switches in `mstar/layers`) call the accessor once and keep
the result. This module imports only the standard library.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TRUE = ("1", "true")
_FALSE = ("0", "false")


class EnvError(ValueError):
    """An MSTAR_* variable holds a value it does not accept; the message says which values it does."""


@dataclass(frozen=True)
class EnvVar:
    """One environment variable as documented: name, type, default (as text) and a one-line meaning."""

    name: str
    type: str  # as shown in the docs: "bool (0/1/true/false)", "0/1/auto", "int", "str", "path"
    default: str  # as shown in the docs; "unset" when absence has its own meaning
    doc: str
    choices: tuple[str, ...] = ()  # accepted values (case-insensitive); empty: any value

    def raw(self) -> str | None:
        """The value set in the environment now, or None when unset or empty."""
        return os.environ.get(self.name) or None

    def choice(self) -> str | None:
        """The value lowercased, checked against `choices`; None when unset or empty."""
        value = self.raw()
        if value is None:
            return None
        if self.choices and value.strip().lower() not in self.choices:
            raise EnvError(f"{self.name}={value!r} is not accepted: set it to one of {', '.join(self.choices)} "
                           f"(or unset it for the default, {self.default})")
        return value.strip().lower()


FUSED_KERNELS = EnvVar(
    "MSTAR_FUSED_KERNELS", "bool (0/1/true/false)", "1",
    "0 keeps the PyTorch layers instead of the fused Triton kernels (read once per process)",
    _TRUE + _FALSE)
SKINNY_GEMM = EnvVar(
    "MSTAR_SKINNY_GEMM", "0/1/auto", "auto",
    "skinny-GEMM kernel for few-row linears: 0 never, 1 wherever allowed, auto timed per shape "
    "(read once per process)",
    ("0", "1", "auto"))
MOE_TILED = EnvVar(
    "MSTAR_MOE_TILED", "bool (0/1/true/false)", "1",
    "0 keeps sparse-MoE decode batches of tens of tokens off the tiled kernels (the small-slot kernels "
    "or the grouped path serve them instead; read once per process)",
    _TRUE + _FALSE)
WAN_GEMM_GELU = EnvVar(
    "MSTAR_WAN_GEMM_GELU", "bool (0/1/true/false)", "1",
    "0 runs the Wan DiT's FFN GELU as its own kernel instead of in the up-projection's cuBLASLt GEMM "
    "epilogue (CUDA, fused kernels on; read once per process)",
    _TRUE + _FALSE)
PDL = EnvVar(
    "MSTAR_PDL", "0/1/auto", "auto",
    "Programmatic Dependent Launch of the decode-step Triton kernels (each launch overlaps the previous "
    "kernel's tail): 0 never, 1 on every CUDA device (an error below sm_90 or without Triton support), "
    "auto on sm_90+ when Triton supports it (read once per process)",
    ("0", "1", "auto"))
STALL_DUMP_S = EnvVar(
    "MSTAR_STALL_DUMP_S", "int", "unset",
    "seconds: a worker whose engine step runs longer writes every thread's stack to stderr (to find "
    "where a stuck server is stuck; read when a worker is built)")
WATCHDOG_S = EnvVar(
    "MSTAR_WATCHDOG_S", "int", "300",
    "seconds without a message from any worker, with requests in flight, after which /health and /ready "
    "answer 503 so an orchestrator restarts the server; raise it for models with longer steps")
CACHE_DIR = EnvVar(
    "MSTAR_CACHE_DIR", "path", "~/.cache/mstar", "where mstar keeps converted checkpoints")
API_KEY = EnvVar(
    "MSTAR_API_KEY", "str", "unset",
    "the Bearer token every route but /health requires (`mstar serve --api-key-file` overrides it); never printed")
SESSION = EnvVar(
    "MSTAR_SESSION", "str", "unset",
    "transport session id (1-32 of [A-Za-z0-9_]) grouping one run's shared-memory segments; the "
    "launcher sets it for worker processes; unset: one per process id")
BENCH_PROFILE_DIR = EnvVar(
    "MSTAR_BENCH_PROFILE_DIR", "path", "unset",
    "benchmarks only: worker processes of benchmarks/runtime_per_token.py dump cProfile stats here")
SCHEMATHESIS_EXAMPLES = EnvVar(
    "MSTAR_SCHEMATHESIS_EXAMPLES", "int", "25",
    "tests only: generated examples per operation in tests/e2e/test_schemathesis.py's slow test (the default "
    "run takes at most 8)")

ALL: tuple[EnvVar, ...] = (FUSED_KERNELS, SKINNY_GEMM, MOE_TILED, WAN_GEMM_GELU, PDL, STALL_DUMP_S, WATCHDOG_S, CACHE_DIR, API_KEY, SESSION, BENCH_PROFILE_DIR,
                           SCHEMATHESIS_EXAMPLES)


def _flag(var: EnvVar, default: bool) -> bool:
    value = var.choice()
    return default if value is None else value in _TRUE


def _positive_int(var: EnvVar, default: int) -> int:
    value = var.raw()
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise EnvError(f"{var.name}={value!r} is not accepted: set it to a whole number >= 1 "
                       f"(or unset it for the default, {var.default})")
    return number


def fused_kernels() -> bool:
    """MSTAR_FUSED_KERNELS: whether the fused Triton kernels may serve (default True)."""
    return _flag(FUSED_KERNELS, default=True)


def skinny_gemm() -> bool | None:
    """MSTAR_SKINNY_GEMM: False (never), True (forced wherever allowed) or None (auto, the default)."""
    value = SKINNY_GEMM.choice()
    return None if value in (None, "auto") else value == "1"


def moe_tiled() -> bool:
    """MSTAR_MOE_TILED: whether the tiled MoE kernels may serve (default True)."""
    return _flag(MOE_TILED, True)


def wan_gemm_gelu() -> bool:
    """MSTAR_WAN_GEMM_GELU: whether the Wan FFN GELU runs in the GEMM epilogue (default True)."""
    return _flag(WAN_GEMM_GELU, default=True)


def pdl() -> bool | None:
    """MSTAR_PDL: False (never), True (on every CUDA device) or None (auto: sm_90+, the default)."""
    value = PDL.choice()
    return None if value in (None, "auto") else value == "1"


def stall_dump_s() -> int | None:
    """MSTAR_STALL_DUMP_S: a whole number of seconds >= 1, or None when unset (no stall dumps)."""
    return None if STALL_DUMP_S.raw() is None else _positive_int(STALL_DUMP_S, default=0)


def watchdog_s() -> int:
    """MSTAR_WATCHDOG_S: a whole number of seconds >= 1 (default 300)."""
    return _positive_int(WATCHDOG_S, default=300)


def cache_dir() -> Path:
    """MSTAR_CACHE_DIR with `~` expanded, else ~/.cache/mstar."""
    value = CACHE_DIR.raw()
    return Path(value).expanduser() if value else Path.home() / ".cache" / "mstar"


def api_key() -> str | None:
    """MSTAR_API_KEY, or None when unset or empty (no authentication)."""
    return API_KEY.raw()


def session() -> str | None:
    """MSTAR_SESSION as set, or None; `mstar.transport.tensors.session_id` validates and defaults it."""
    return SESSION.raw()


def bench_profile_dir() -> Path | None:
    """MSTAR_BENCH_PROFILE_DIR, or None when unset (benchmarks only)."""
    value = BENCH_PROFILE_DIR.raw()
    return Path(value) if value else None


def schemathesis_examples() -> int:
    """MSTAR_SCHEMATHESIS_EXAMPLES: a whole number >= 1 (default 25; tests only)."""
    return _positive_int(SCHEMATHESIS_EXAMPLES, default=25)


def describe() -> str:
    """A Markdown table of every variable (name, type, default, meaning), as docs/structure.md shows it."""
    rows = ["| Variable | Type | Default | Meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{v.name}` | {v.type} | {v.default} | {v.doc} |" for v in ALL]
    return "\n".join(rows) + "\n"
