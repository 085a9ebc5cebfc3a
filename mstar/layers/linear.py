"""`linear(x, module)`: F.linear, or the skinny-GEMM Triton kernel where it is measured to be faster.

Decode runs the projections with a handful of rows, where reading the weight is the whole cost and
cuBLAS does not always reach full bandwidth. For 2-D contiguous x with at most `SKINNY.max_m` rows
on a device the fused kernels serve (`FUSED.ops_for`), the choice between `skinny_linear` and
F.linear is made once per (M bucket, N, K, dtype, bias, device) by timing both with CUDA events the
first time that shape is seen outside a CUDA-graph capture (the engine's warm-up); the choice is then
fixed for the process, so results are deterministic per shape. A shape first seen during a capture
uses F.linear for good (timing needs host syncs). On CPU (Triton interpreter) the kernel runs only when
`SKINNY.force` is True (tests). MSTAR_SKINNY_GEMM=0 turns it off, =1 forces it on wherever allowed.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from mstar import envs
from mstar.layers.fused import FUSED

logger = logging.getLogger(__name__)

_Key = tuple[int, int, int, torch.dtype, bool, torch.device]


class _SkinnySwitch:
    """Process-wide state of the skinny-GEMM choice; tests set `force` (True/False/None)."""

    def __init__(self) -> None:
        self.force: bool | None = envs.skinny_gemm()
        self.max_m = 64  # never above skinny_gemm.MAX_M
        self.iters = 10  # timed calls per candidate
        self.decisions: dict[_Key, bool] = {}
        self._flush: dict[torch.device, torch.Tensor] = {}

    def use_skinny(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether skinny_linear should run x @ weight.T (+ bias); measures once per shape on CUDA."""
        if self.force is not None:
            return self.force
        if not x.is_cuda:
            return False
        from mstar.kernels.skinny_gemm import m_bucket

        key = (m_bucket(x.shape[0]), weight.shape[0], weight.shape[1], x.dtype, bias is not None, x.device)
        decision = self.decisions.get(key)
        if decision is None:
            if torch.cuda.is_current_stream_capturing():
                # Timing needs host syncs; F.linear from now on keeps this shape's choice fixed.
                logger.warning("skinny GEMM: shape %s first seen inside a CUDA-graph capture; using F.linear", key)
                self.decisions[key] = False
                return False
            decision = self.decisions[key] = self._measure(x, weight, bias)
        return decision

    def _measure(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        from mstar.kernels.skinny_gemm import skinny_linear

        t_skinny = self._time(lambda: skinny_linear(x, weight, bias), x.device)
        t_torch = self._time(lambda: F.linear(x, weight, bias), x.device)
        faster = t_skinny < t_torch
        logger.info("skinny GEMM M=%d N=%d K=%d %s: skinny %.1f us, F.linear %.1f us -> %s", x.shape[0],
                    weight.shape[0], weight.shape[1], x.dtype, t_skinny, t_torch,
                    "skinny" if faster else "F.linear")
        return faster

    @torch.inference_mode()  # the flush buffer may be an inference tensor (first made under inference mode)
    def _time(self, fn, device: torch.device) -> float:
        """Median microseconds of `fn` with L2 flushed before each call (decode reads cold weights)."""
        flush = self._flush.get(device)
        if flush is None:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
            flush = self._flush[device] = torch.empty(2 * l2 // 4, dtype=torch.float32, device=device)
        fn()  # compile / lazy init outside the timing
        times = []
        for _ in range(self.iters):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0)
        return sorted(times)[len(times) // 2]


SKINNY = _SkinnySwitch()


def linear(x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
    """module(x) for an nn.Linear: through skinny_linear for few-row inputs where it wins, else F.linear."""
    weight, bias = module.weight, module.bias
    if (
        x.dim() == 2
        and 0 < x.shape[0] <= SKINNY.max_m
        and SKINNY.force is not False
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.is_contiguous()
        and weight.is_contiguous()
        and FUSED.ops_for(x) is not None
        and SKINNY.use_skinny(x, weight, bias)
    ):
        from mstar.kernels.skinny_gemm import skinny_linear

        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)
