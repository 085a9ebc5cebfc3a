"""`linear(x, module)`: F.linear, or the skinny-GEMM Triton kernel where it is measured to be faster
(`linear_weight(x, weight, bias)`: the same for a bare weight tensor);
`silu_and_mul_linear(gate_up, module)`: the same for a down projection, with the SiLU-and-mul fused in;
`gemm_gelu(x, weight, bias)`: an up projection with its bias and (tanh) GELU in cuBLASLt's epilogue on CUDA
(`gemm_gelu_serves` says where).

Decode runs the projections with a handful of rows, where reading the weight is the whole cost and
cuBLAS does not always reach full bandwidth. For 2-D contiguous x with at most `SKINNY.max_m` rows
on a device the fused kernels serve (`FUSED.ops_for`), the choice between `skinny_linear` and
F.linear is made once per (M bucket, N, K, dtype, bias, device) the first time that shape is seen
outside a CUDA-graph capture (the engine's warm-up), by timing both inside a CUDA graph of
back-to-back calls that read the weight from HBM (`mstar.kernels.timing.graph_time_us`: what a call
costs in a decode graph, not the host's launch latency). The choice is then fixed for the process,
so results are deterministic per shape. Likewise, for up to 4 rows, `skinny_silu_and_mul_linear` is
timed against the SiLU kernel followed by the best linear. A shape first seen during a capture uses
the unfused F.linear path for good (timing needs host syncs). On CPU (Triton interpreter) the
kernels run only when `SKINNY.force` is True (tests). MSTAR_SKINNY_GEMM=0 turns them off, =1 forces
them on wherever allowed.

An `Fp8Linear` (layers/fp8.py) runs `fp8_linear` instead (the FP8 GEMV below 16 rows, `torch._scaled_mm`
above 64), except that for 1 to 64 rows, where the FP8 GEMV serves, the kernels that serve the shape
(`fp8_candidates`: the FP8 GEMV with its own configs, the skinny GEMM's tl.dot kernel on the E4M3 weight
at the bf16 configs, and from 16 rows `torch._scaled_mm`, activation quantization included) are timed
as above and the fastest kept; and for up to 4 rows the FP8 GEMV with SiLU-and-mul fused into its
x-load is timed against the SiLU kernel followed by the down projection `linear` would run.

On CPU, float32 linears whose weights `pack_cpu_linears` reordered (the autoregressive engine does it
when it is built on CPU, after the weights load) run through oneDNN with the weight in its blocked
layout: MKL's sgemm, which F.linear calls, reads the weight far below the memory bandwidth for a few
rows. The packed copy is made once and not refreshed: weights changed in place afterwards are not seen.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from mstar import envs
from mstar.layers.fp8 import (
    Fp8Linear,
    fp8_linear,
    gated_gemv_serves,
    gemv_linear,
    gemv_serves,
    scaled_mm,
    scaled_mm_linear,
    scaled_mm_serves,
    silu_and_mul_gemv_linear,
    skinny_dot_linear,
)
from mstar.layers.fused import FUSED

logger = logging.getLogger(__name__)
T = TypeVar("T")

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_GEMV_MAX_M = 4  # mstar.kernels.gemv.MAX_M, kept here so this module imports no Triton


class _SkinnySwitch:
    """Process-wide state of the skinny-GEMM choices; tests set `force` (True/False/None)."""

    def __init__(self) -> None:
        self.force: bool | None = envs.skinny_gemm()
        self.max_m = 64  # never above skinny_gemm.MAX_M
        self.replays = 5  # timed replays of each candidate's graph (the median is kept)
        self.decisions: dict[tuple, object] = {}  # key -> what `_decide` answers for it

    def use_skinny(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether skinny_linear should run x @ weight.T (+ bias); measures once per shape on CUDA."""
        return self._decide(self._key(x, weight, bias), x.is_cuda, lambda: self._measure_linear(x, weight, bias))

    def use_fused_silu(self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether skinny_silu_and_mul_linear should run the down projection of `gate_up`; measured
        once per shape on CUDA against silu_and_mul followed by the best linear."""
        key = ("silu_and_mul",) + self._key(gate_up, weight, bias)
        return self._decide(key, gate_up.is_cuda, lambda: self._measure_fused_silu(gate_up, weight, bias))

    def fp8_kernel(self, x: torch.Tensor, module: Fp8Linear) -> str | None:
        """Which of `FP8_KERNELS` should run `module` on the 2-D rows x (those `fp8_candidates` lists),
        measured once per shape on CUDA; None: `fp8_linear`'s own order (unmeasured). Forced: the GEMV."""
        # rows 9 to 16 share an M bucket, but `_scaled_mm` serves only from SCALED_MM_MIN_ROWS: each set of
        # candidates gets its own decision, so that no row count runs a kernel that does not serve it
        key = ("fp8", module.block, scaled_mm_serves(x, module)) + self._key(x, module.weight, module.bias)
        return self._decide(key, x.is_cuda, lambda: self._measure_fp8(x, module), on="gemv", off=None)

    def use_fp8_fused_silu(self, gate_up: torch.Tensor, module: Fp8Linear) -> bool:
        """Whether the FP8 GEMV with SiLU-and-mul fused in should run the down projection of `gate_up`;
        measured once per shape on CUDA against silu_and_mul followed by the FP8 kernel `linear` would run."""
        key = ("fp8_silu_and_mul", module.block) + self._key(gate_up, module.weight, module.bias)
        return self._decide(key, gate_up.is_cuda, lambda: self._measure_fp8_fused_silu(gate_up, module))

    @staticmethod
    def _key(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        from mstar.kernels.skinny_gemm import m_bucket

        return (m_bucket(x.shape[0]), weight.shape[0], weight.shape[1], x.dtype, bias is not None, x.device)

    def _decide(self, key: tuple, is_cuda: bool, measure: Callable[[], T], on: T = True, off: T = False) -> T:
        """`measure()` the first time `key` is seen on CUDA, then the same answer; `on` when forced, `off`
        when forced off, on CPU, or first seen inside a CUDA-graph capture."""
        if self.force is not None:
            return on if self.force else off
        if not is_cuda:  # the interpreter runs the kernels only when forced (tests)
            return off
        if key not in self.decisions:
            if torch.cuda.is_current_stream_capturing():
                # Timing needs host syncs; the unfused default path from now on keeps this choice fixed.
                logger.warning("skinny GEMM: shape %s first seen inside a CUDA-graph capture; using the default path", key)
                self.decisions[key] = off
                return off
            self.decisions[key] = measure()
        return self.decisions[key]

    def _measure_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        from mstar.kernels.skinny_gemm import skinny_linear

        times = self._time({"skinny": lambda w: skinny_linear(x, w, bias), "F.linear": lambda w: F.linear(x, w, bias)},
                           weight)
        if times is None:
            return False
        logger.info("skinny GEMM M=%d N=%d K=%d %s: skinny %.1f us, F.linear %.1f us", x.shape[0], weight.shape[0],
                    weight.shape[1], x.dtype, times["skinny"], times["F.linear"])
        return times["skinny"] < times["F.linear"]

    def _measure_fused_silu(self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        from mstar.kernels.fused_ops import silu_and_mul
        from mstar.kernels.skinny_gemm import skinny_linear, skinny_silu_and_mul_linear

        act = silu_and_mul(gate_up)
        best = skinny_linear if self.use_skinny(act, weight, bias) else F.linear
        times = self._time({"fused": lambda w: skinny_silu_and_mul_linear(gate_up, w, bias),
                            "separate": lambda w: best(silu_and_mul(gate_up), w, bias)}, weight)
        if times is None:
            return False
        logger.info("silu_and_mul + down M=%d N=%d K=%d %s: fused %.1f us, silu_and_mul + %s %.1f us",
                    gate_up.shape[0], weight.shape[0], weight.shape[1], gate_up.dtype, times["fused"],
                    best.__name__, times["separate"])
        return times["fused"] < times["separate"]

    def _measure_fp8(self, x: torch.Tensor, module: Fp8Linear) -> str | None:
        times = self._time({name: functools.partial(kernel, x) for name, kernel in fp8_candidates(x, module).items()},
                           module.weight)
        if times is None:
            return None
        logger.info("FP8 linear M=%d N=%d K=%d %s: %s", x.shape[0], module.out_features, module.in_features,
                    "per channel" if module.block is None else f"blocks {module.block}",
                    ", ".join(f"{name} {us:.1f} us" for name, us in times.items()))
        return min(times, key=times.__getitem__)

    def _measure_fp8_fused_silu(self, gate_up: torch.Tensor, module: Fp8Linear) -> bool:
        from mstar.kernels.fp8_gemv import fp8_gemv
        from mstar.kernels.fused_ops import silu_and_mul

        scale, bias, block = module.weight_scale, module.bias, module.block
        act = silu_and_mul(gate_up)
        best = self.fp8_kernel(act, module) or "gemv"  # the down projection `linear` would run unfused
        separate = fp8_candidates(act, module)[best]
        times = self._time({"fused": lambda w: fp8_gemv(gate_up, w, scale, bias, block, gated=True),
                            "separate": lambda w: separate(silu_and_mul(gate_up), w)}, module.weight)
        if times is None:
            return False
        logger.info("FP8 silu_and_mul + down M=%d N=%d K=%d %s: fused %.1f us, silu_and_mul + %s %.1f us",
                    gate_up.shape[0], module.out_features, module.in_features, gate_up.dtype, times["fused"], best,
                    times["separate"])
        return times["fused"] < times["separate"]

    @torch.inference_mode()  # weights and buffers may be inference tensors (made under inference mode)
    def _time(self, candidates: dict[str, Callable[[torch.Tensor], object]],
              weight: torch.Tensor) -> dict[str, float] | None:
        """GPU microseconds per call of each candidate in a decode-like CUDA graph; None if the timing
        copies do not fit in memory (the caller then keeps the default path: F.linear, `fp8_linear`)."""
        from mstar.kernels.timing import graph_time_us

        try:
            return {name: graph_time_us(fn, weight, replays=self.replays) for name, fn in candidates.items()}
        except torch.cuda.OutOfMemoryError:
            logger.warning("skinny GEMM: no memory for the timing copies of a %s weight; using the default path",
                           tuple(weight.shape))
            return None


SKINNY = _SkinnySwitch()

# What runs an Fp8Linear where `SKINNY.fp8_kernel` chose by timing (the names `fp8_candidates` gives).
FP8_KERNELS: dict[str, Callable[[torch.Tensor, Fp8Linear], torch.Tensor]] = {
    "gemv": gemv_linear, "skinny_dot": skinny_dot_linear, "scaled_mm": scaled_mm_linear}


def fp8_candidates(x: torch.Tensor, module: Fp8Linear) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The kernels that can run `module` on the 2-D rows x (where `gemv_serves`), by their `FP8_KERNELS`
    name, each as fn(rows, weight) with the module's scales and bias: what `SKINNY.fp8_kernel` times, on
    copies of the weight."""
    from mstar.kernels.fp8_gemv import fp8_gemv, fp8_skinny_linear

    scale, bias, block = module.weight_scale, module.bias, module.block
    out = {"gemv": lambda rows, w: fp8_gemv(rows, w, scale, bias, block),
           "skinny_dot": lambda rows, w: fp8_skinny_linear(rows, w, scale, bias, block)}
    if scaled_mm_serves(x, module):
        out["scaled_mm"] = lambda rows, w: scaled_mm(rows, w, scale, bias)
    return out


class _CpuPacked:
    """float32 CPU weights reordered once into oneDNN's blocked layout, by the weight's identity."""

    def __init__(self) -> None:
        self.enabled = torch.backends.mkldnn.is_available()
        self._packed: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def pack(self, weight: torch.Tensor) -> None:
        """Keep a reordered copy of `weight` [N, K] (float32, CPU) for `get`, until `weight` is freed."""
        if not self.enabled or id(weight) in self._packed:
            return
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self._packed[id(weight)] = (weakref.ref(weight), packed)
        weakref.finalize(weight, self._packed.pop, id(weight), None)

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The reordered copy of `weight`, or None when it was never packed."""
        entry = self._packed.get(id(weight))
        return entry[1] if entry is not None and entry[0]() is weight else None


CPU_PACKED = _CpuPacked()


def pack_cpu_linears(model: nn.Module) -> int:
    """Reorder the weight of every float32 CPU nn.Linear of `model` for oneDNN (module docstring); how
    many weights were packed (0 where oneDNN is unavailable)."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)
               and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32}
    for weight in weights.values():
        CPU_PACKED.pack(weight)
    return len(weights) if CPU_PACKED.enabled else 0


def linear(x: torch.Tensor, module: nn.Linear | Fp8Linear) -> torch.Tensor:
    """module(x) for an nn.Linear: through skinny_linear for few-row inputs where it wins, else F.linear;
    an Fp8Linear through the FP8 kernel timed fastest for the shape (`FP8_KERNELS`), else `fp8_linear`."""
    if isinstance(module, Fp8Linear):
        if gemv_serves(x, module) and SKINNY.force is not False and \
                (kernel := SKINNY.fp8_kernel(x.reshape(-1, module.in_features), module)) is not None:
            return FP8_KERNELS[kernel](x, module)
        return fp8_linear(x, module)
    return linear_weight(x, module.weight, module.bias)


def linear_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with `linear`'s choice of the skinny GEMV: for a weight that is no
    module's own, e.g. a contiguous row slice of an output head."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and (packed := CPU_PACKED.get(weight)) is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if (
        x.dim() == 2
        and 0 < x.shape[0] <= SKINNY.max_m
        and SKINNY.force is not False
        and x.dtype == weight.dtype
        and x.dtype in _DTYPES
        and x.is_contiguous()
        and weight.is_contiguous()
        and FUSED.ops_for(x) is not None
        and SKINNY.use_skinny(x, weight, bias)
    ):
        from mstar.kernels.skinny_gemm import skinny_linear

        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_and_mul_linear(gate_up: torch.Tensor, module: nn.Linear | Fp8Linear) -> torch.Tensor:
    """module(silu(gate) * up) for 2-D contiguous gate_up = [gate | up] on a device the fused kernels
    serve: one fused GEMV where it is measured to win, else fused_ops.silu_and_mul then `linear`."""
    ops = FUSED.ops_for(gate_up)
    if ops is None or gate_up.dim() != 2 or not gate_up.is_contiguous():
        raise ValueError(f"silu_and_mul_linear needs a 2-D contiguous gate_up the fused kernels serve, got "
                         f"{tuple(gate_up.shape)} on {gate_up.device}; use F.silu(gate) * up and linear()")
    if isinstance(module, Fp8Linear):
        if gated_gemv_serves(gate_up, module) and SKINNY.force is not False and SKINNY.use_fp8_fused_silu(gate_up, module):
            return silu_and_mul_gemv_linear(gate_up, module)
        return linear(ops.silu_and_mul(gate_up), module)
    weight, bias = module.weight, module.bias
    if (
        0 < gate_up.shape[0] <= _GEMV_MAX_M
        and SKINNY.force is not False
        and gate_up.dtype == weight.dtype
        and gate_up.dtype in _DTYPES
        and gate_up.shape[1] == 2 * weight.shape[1]
        and weight.is_contiguous()
        and SKINNY.use_fused_silu(gate_up, weight, bias)
    ):
        from mstar.kernels.skinny_gemm import skinny_silu_and_mul_linear

        return skinny_silu_and_mul_linear(gate_up, weight, bias)
    return linear(ops.silu_and_mul(gate_up), module)


def gemm_gelu_serves(device: torch.device, dtype: torch.dtype, module: nn.Module) -> bool:
    """Whether `gemm_gelu` can run `module` on activations of `device` and `dtype`: a CUDA nn.Linear (not an
    `Fp8Linear`) with a bias, in bfloat16 or float16 as the activations, outside torch.compile (inductor
    fuses the GELU itself)."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and type(module) is nn.Linear
            and module.bias is not None and module.weight.dtype == module.bias.dtype == dtype
            and not torch.compiler.is_compiling())


def gemm_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU(x @ weight.T + bias) [..., out] as one `torch._addmm_activation`.

    CUDA: cuBLASLt's GELU_BIAS epilogue, the tanh approximation applied to the float32 accumulator and
    rounded once (PyTorch falls back to GEMM + in-place tanh GELU where Lt does not apply). CPU: addmm +
    exact (erf) GELU, PyTorch's CPU semantics of the op, which is why callers send only CUDA tensors here.
    """
    flat = x.reshape(-1, x.shape[-1])
    out = torch._addmm_activation(bias, flat, weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], out.shape[-1])
