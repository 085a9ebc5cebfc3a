"""Programmatic Dependent Launch (PDL, Hopper sm_90+) for the Triton kernels of a decode step.

A decode step is a few hundred kernels, many of one or two microseconds; in a CUDA-graph replay each
still pays its launch, the ramp-up of its blocks and the drain of the previous kernel. Launched with
PDL (`launch_pdl=True`), a kernel may start as soon as every program of the kernel before it in the
stream has called `gdc_launch_dependents()` (or exited), so its blocks are scheduled, and can issue
loads of constant data, while the previous kernel finishes. `gdc_wait()` then blocks until the
previous kernel has completed and its memory is visible.

The contract every kernel launched here keeps (the kernel modules point to it):

1. Each program calls `pdl_wait` before it reads anything an earlier kernel may write and before it
   writes anything at all. Only reads of data that no PDL kernel writes during a step may come
   before it: the GEMV's first weight tile (`gemv.py`), and the decode attention's sequence lengths,
   block tables (written by copies queued before the step's kernels) and first block of cached keys
   and values (positions before the new token, written by earlier steps; `decode_attention.py`).
   Each hides one DRAM latency per launch.
2. Each program calls `pdl_launch_dependents` at its start: the next kernel's early work is only the
   constant reads rule 1 allows, so it may start at once.

Why that is enough: kernel C's wait returns once B has completed; B completed only after its own
wait returned, i.e. after A completed; so when C's wait returns every earlier kernel has completed
(read-after-write), and since C writes nothing before it, C cannot overwrite what an earlier kernel
still reads (write-after-read: memory freed and reused by the caching allocator, split-K
workspaces and counters). Kernels launched without PDL (torch ops, cuBLAS) keep full stream order
and end the chain safely: a PDL kernel after one waits for it, and it waits for everything before.
Split-K counters and workspaces are touched only after the wait, so consecutive launches sharing
them still use them one after another.

What rule 1 asks of weights: they are complete before the step starts. A read before the wait is
ordered only after kernels that completed before the last kernel launched without PDL started, so a
weight written by a kernel and read at once by a GEMV (no synchronisation, no ordinary torch kernel
in between) could be read stale. Loading ends long before serving; tests that build a weight and
call a GEMV right away synchronise first.

What it asks of the decode attention's early reads: lengths and block tables are copied in (copies
keep full stream order) and the cached keys and values it reads early were written by an earlier
forward, which ends before the next one's first kernel, launched without PDL (the embedding gather),
starts. A caller that wrote them with a PDL kernel and ran the decode kernel right after, with no
ordinary kernel or copy in between, would break this.

`PDL` decides per device whether kernels launch this way (MSTAR_PDL: 0 never, 1 on every CUDA
device, auto on sm_90+ when Triton supports it), read once per process; tests and benchmarks set
`PDL.mode`. Never under TRITON_INTERPRET=1 or for CPU tensors: the interpreter has no gdc_* ops.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mstar import envs

MIN_CAPABILITY = (9, 0)  # griddepcontrol is a Hopper instruction


def triton_supports_pdl() -> bool:
    """Whether this Triton has the `launch_pdl` launch option and the gdc_* ops of tl.extra.cuda."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda
    except ImportError:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return "launch_pdl" in fields and hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


class _PdlSwitch:
    """Process-wide PDL choice; `mode` is True (on, an error where impossible), False (off) or None (auto)."""

    def __init__(self) -> None:
        self.mode: bool | None = envs.pdl()
        self.interpret = os.environ.get("TRITON_INTERPRET") == "1"
        self._supported: dict[int, bool] = {}  # device index -> capability and Triton allow it

    def enabled(self, device: torch.device) -> bool:
        """Whether kernels working on `device` launch with PDL."""
        if self.mode is False or device.type != "cuda" or self.interpret:
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        supported = self._supported.get(index)
        if supported is None:
            supported = self._supported[index] = (
                torch.cuda.get_device_capability(index) >= MIN_CAPABILITY and triton_supports_pdl())
        if self.mode is True and not supported:
            raise RuntimeError(f"MSTAR_PDL=1 but cuda:{index} (capability "
                               f"{torch.cuda.get_device_capability(index)}) or Triton {triton.__version__} "
                               "cannot launch with PDL (needs sm_90+ and launch_pdl); unset MSTAR_PDL or set 0")
        return supported

    def launch(self, device: torch.device) -> dict:
        """Keyword arguments for a kernel launch: the kernel's `PDL` constexpr, plus `launch_pdl=True`
        when on (the two always go together: a PDL launch of a kernel without its wait would race)."""
        return {"PDL": True, "launch_pdl": True} if self.enabled(device) else {"PDL": False}


PDL = _PdlSwitch()


def pdl_args(device: torch.device) -> dict:
    """`PDL.launch(device)`: what every kernel launcher of a decode step passes to its launch."""
    return PDL.launch(device)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(PDL: tl.constexpr):
    """Let the next PDL-launched kernel start once every program of this one has called this."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
