"""Sort profiler kernel (or CPU op) names into coarse categories, and tell which SDPA backend ran.

Names are matched by substrings seen in PyTorch / cuBLAS / cuDNN / flash-attention kernel names on Hopper
(e.g. `nvjet_tst_...` and `sm90_xmma_gemm_...` are cuBLAS GEMMs, `pytorch_flash::flash_fwd_kernel` is
SDPA's flash backend, `fmha_cutlassF...` its memory-efficient one, `cudnn_generated_..._sdpa_...` or
`..._fprop_...` cuDNN's fused attention). The same rules read CPU op names (`aten::addmm`) in --quick mode.
"""

from __future__ import annotations

from collections.abc import Iterable

CATEGORIES = ("GEMM", "attention", "norm", "elementwise/copy", "other")

# Checked in this order: the first category with a matching substring wins (lower-cased names).
_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "_efficient_attention", "softmax", "fprop")),
    ("GEMM", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::linear", "aten::baddbmm", "wgmma", "splitkreduce", "convolution")),
    ("norm", ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "rowwisemoments", "welford", "norm_kernel",
              "norm_ndhwc", "aten::native_layer_norm")),
    ("elementwise/copy", ("elementwise", "vectorized", "unrolled", "copy", "memcpy", "memset", "fill",
                          "cat", "flip", "aten::add", "aten::mul", "aten::sub", "aten::to", "aten::gelu",
                          "aten::silu", "gelu", "silu", "aten::stack", "aten::addcmul", "aten::empty",
                          "index", "where", "clone", "contiguous")),
)


def categorize(name: str) -> str:
    """One of CATEGORIES for a kernel or op name ("other" when no rule matches)."""
    lowered = name.lower()
    for category, needles in _RULES:
        if any(needle in lowered for needle in needles):
            return category
    return "other"


def sdpa_backends(names: Iterable[str]) -> list[str]:
    """Which SDPA backends' kernels appear among `names`: a sorted subset of cudnn, flash, efficient, math.

    cuDNN's attention kernels may also contain "flash" in their names, so they are told apart first;
    "math" is the unfused fallback (batched GEMMs around a softmax kernel)."""
    found = set()
    for name in names:
        lowered = name.lower()
        if "cudnn" in lowered and any(k in lowered for k in ("sdpa", "fmha", "flash", "fprop", "attn")):
            found.add("cudnn")
        elif "flash" in lowered:
            found.add("flash")
        elif "fmha_cutlass" in lowered or "efficient_attention" in lowered or "mem_eff" in lowered:
            found.add("efficient")
        elif "softmax" in lowered:
            found.add("math")
    return sorted(found)
