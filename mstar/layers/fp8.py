"""FP8 (E4M3) weights: the quantize/dequantize formulas, `Fp8Linear` and its matmul, and
`quantize_linears`, which swaps a module's nn.Linear layers for FP8 ones (`empty_fp8_decoder`: before loading).

`empty_fp8_decoder` swaps them for empty ones before any weight exists (a module built on the meta
device): the loader (`models.common.loading`) then quantizes each layer as its full-precision weight
arrives, so no full-precision copy of those layers is ever held on the device.

A weight W [N, K] is stored as q = round_e4m3(W / s) (float8_e4m3fn, saturated at +-448) with float32
scales s of one of two shapes:
  per output channel  s [N, 1]          = amax(|W[n, :]|) / 448
  blocks (bn x bk)    s [N/bn, K/bk]   = amax(|W[block]|) / 448 (ceil-divided; the last block may be short)
and W ~ q * s, expanded to W's shape. The Hugging Face formats store the same s: `weight_scale_inv`
(fine-grained FP8, blocks) and `weight_scale` (compressed-tensors, per channel); both are multiplied.

`fp8_linear` picks one of three paths, each with a CPU reference:
  weight-only  (`weight_only_linear`) the weight dequantized in float32, rounded to the activation dtype,
               then F.linear in that dtype: the CPU path, and CUDA where neither kernel below serves
               (float32 inputs; block scales above FP8_GEMV_MAX_ROWS rows);
  FP8 GEMV     (`gemv_linear`, `mstar.kernels.fp8_gemv`) on CUDA for bfloat16/float16 inputs of fewer than
               SCALED_MM_MIN_ROWS rows, and up to FP8_GEMV_MAX_ROWS where `torch._scaled_mm` does not
               serve (decode batches): reads the E4M3 weight once, accumulates in float32, scales per
               channel or per block; weight-only numerics without the rounding of q * s, so
               `weight_only_linear` is its reference (`silu_and_mul_gemv_linear`: the same with
               SiLU-and-mul fused into a down projection; `skinny_dot_linear`: the same numerics through
               the skinny GEMM's tl.dot kernel at the bf16 configs, split-K included);
  W8A8         (`scaled_mm_linear`) on CUDA for bfloat16 inputs of at least SCALED_MM_MIN_ROWS rows and
               per-channel weights: the activations quantized per token (the same formula as the weight's
               rows, in one Triton kernel: `quantize_activations`) and `torch._scaled_mm` with both scales,
               accumulating in float32, the bias added in its epilogue before the one rounding to bfloat16;
               `w8a8_reference` is its CPU emulation.
Where more than one of `gemv_linear`, `skinny_dot_linear` and `scaled_mm_linear` serves, `layers.linear.linear`
runs the one it timed fastest for the shape at warm-up; `fp8_linear` alone takes the order above.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar.kernels.guard import KernelGuard
from mstar.layers.fused import FUSED

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_SCALE = 1e-12  # an all-zero row or block still gets a finite scale (its q is all zero)
_QUANTIZE_ROWS = KernelGuard("FP8 activation quantization")
METHODS = {"fp8": None, "fp8_block": (128, 128)}  # setting -> block shape (None: per output channel)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [N, K], s float32 [N, 1]) with weight ~ q * s, s = row amax / 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return _to_fp8(w / scale), scale


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [N, K], s float32 [ceil(N/bn), ceil(K/bk)]) with weight ~ q * s per block."""
    w = weight.float()
    n, k = w.shape
    bn, bk = block
    padded = F.pad(w.abs(), (0, -k % bk, 0, -n % bn))  # zeros never raise an amax
    amax = padded.reshape(math.ceil(n / bn), bn, math.ceil(k / bk), bk).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return _to_fp8(w / expand_scale(scale, (n, k), block)), scale


def _to_fp8(values: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even into E4M3, saturating instead of overflowing to NaN."""
    return values.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] | None) -> torch.Tensor:
    """The scale broadcastable to a weight of `shape`: [N, 1] as is, a block grid repeated over each block."""
    if block is None:
        return scale
    n, k = shape
    return scale.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """q * s in float32, the scale expanded to q's shape."""
    return q.float() * expand_scale(scale, tuple(q.shape), block)


class Fp8Linear(nn.Module):
    """A linear layer with an E4M3 weight [out, in] and float32 scales (`block` None: per output channel).

    `weight` and `weight_scale` are parameters (no gradient) so checkpoints load into them by name;
    `source_dtype` is the dtype of the full-precision weight it stands for (its bias's, and the one a
    full-precision weight is rounded to before `set_weight` quantizes it on load).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int] | None,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.source_dtype = dtype
        rows, cols = (out_features, 1) if block is None else (math.ceil(out_features / block[0]),
                                                                math.ceil(in_features / block[1]))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(rows, cols, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, block: tuple[int, int] | None) -> Fp8Linear:
        """`linear` quantized: E4M3 weight and scales of `block` shape, its bias kept in its dtype."""
        weight = linear.weight.detach()
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, block, weight.dtype,
                     weight.device)
        module.set_weight(weight)
        if linear.bias is not None:
            with torch.no_grad():
                module.bias.copy_(linear.bias)
        return module

    def set_weight(self, weight: torch.Tensor) -> None:
        """Quantize the full-precision `weight` [out, in] (any device) into `weight` and `weight_scale`."""
        weight = weight.to(self.weight.device)
        q, scale = quantize_per_channel(weight) if self.block is None else quantize_blocks(weight, self.block)
        with torch.no_grad():
            self.weight.copy_(q)
            self.weight_scale.copy_(scale)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as `dtype`: q * s computed in float32, then rounded once."""
        return dequantize(self.weight, self.weight_scale, self.block).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self)

    def extra_repr(self) -> str:
        scales = "per channel" if self.block is None else f"blocks {self.block[0]}x{self.block[1]}"
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3, {scales}"


SCALED_MM_MIN_ROWS = 16  # fewer rows (decode) are weight-bound: reading FP8 weights is the gain, not FP8 math
FP8_GEMV_MAX_ROWS = 64  # mstar.kernels.fp8_gemv.MAX_M, kept here so this module imports no Triton


def fp8_linear(x: torch.Tensor, module: Fp8Linear) -> torch.Tensor:
    """x @ W.T (+ bias) for the module's FP8 weight: the FP8 GEMV below SCALED_MM_MIN_ROWS rows, W8A8
    through `torch._scaled_mm` from there, the FP8 GEMV where only it serves, else the weight-only
    reference (module docstring). `layers.linear.linear` times the kernels that serve x instead."""
    if gemv_serves(x, module) and x.numel() < SCALED_MM_MIN_ROWS * module.in_features:
        return gemv_linear(x, module)
    if scaled_mm_serves(x, module):
        return scaled_mm_linear(x, module)
    if gemv_serves(x, module):
        return gemv_linear(x, module)
    return weight_only_linear(x, module)


def weight_only_linear(x: torch.Tensor, module: Fp8Linear) -> torch.Tensor:
    """F.linear with the module's weight dequantized to x's dtype: the weight-only reference."""
    bias = None if module.bias is None else module.bias.to(x.dtype)
    return F.linear(x, module.dequantized(x.dtype), bias)


def gemv_serves(x: torch.Tensor, module: Fp8Linear) -> bool:
    """Whether the FP8 GEMV's kernels (`gemv_linear`, `skinny_dot_linear`) can run x: CUDA bfloat16/float16,
    1 to FP8_GEMV_MAX_ROWS rows, block scales (if any) whose columns the tl.dot kernel's K chunk divides."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and 0 < x.numel() <= FP8_GEMV_MAX_ROWS * module.in_features
            and (module.block is None or module.block[1] % 16 == 0))  # the tl.dot kernel's K chunk


FP8_GATED_MAX_ROWS = 4  # mstar.kernels.fp8_gemv.GEMV_MAX_M: the GEMV that takes silu(gate) * up in its x-load


def gated_gemv_serves(gate_up: torch.Tensor, module: Fp8Linear) -> bool:
    """Whether `silu_and_mul_gemv_linear` can run `module` on gate_up [M, 2K] = [gate | up]: CUDA bf16/fp16
    rows of at most FP8_GATED_MAX_ROWS, contiguous."""
    return (gate_up.is_cuda and gate_up.dtype in (torch.bfloat16, torch.float16) and gate_up.dim() == 2
            and 0 < gate_up.shape[0] <= FP8_GATED_MAX_ROWS and gate_up.shape[1] == 2 * module.in_features
            and gate_up.is_contiguous() and (module.block is None or module.block[1] % 16 == 0))


def silu_and_mul_gemv_linear(gate_up: torch.Tensor, module: Fp8Linear) -> torch.Tensor:
    """module(silu(gate) * up) in one FP8 GEMV launch (`gated_gemv_serves` says where; also on CPU under
    TRITON_INTERPRET=1, for tests)."""
    from mstar.kernels.fp8_gemv import fp8_gemv

    return fp8_gemv(gate_up, module.weight, module.weight_scale, module.bias, module.block, gated=True)


def gemv_linear(x: torch.Tensor, module: Fp8Linear) -> torch.Tensor:
    """The FP8 GEMV (`mstar.kernels.fp8_gemv`) for x of at most FP8_GEMV_MAX_ROWS rows of bfloat16 or float16,
    on CUDA (or on CPU under TRITON_INTERPRET=1, for tests)."""
    from mstar.kernels.fp8_gemv import fp8_gemv

    return _on_rows(fp8_gemv, x, module)


def skinny_dot_linear(x: torch.Tensor, module: Fp8Linear) -> torch.Tensor:
    """`gemv_linear`'s numerics through the skinny GEMM's tl.dot kernel at the bf16 configs, K split where
    N gives too few programs (`fp8_gemv.fp8_skinny_linear`); where `gemv_linear` serves."""
    from mstar.kernels.fp8_gemv import fp8_skinny_linear

    return _on_rows(fp8_skinny_linear, x, module)


def _on_rows(kernel, x: torch.Tensor, module: Fp8Linear) -> torch.Tensor:
    """`kernel(rows, q, s, bias, block)` on x's rows as one contiguous 2-D batch, reshaped back."""
    rows = x.reshape(-1, module.in_features).contiguous()
    out = kernel(rows, module.weight, module.weight_scale, module.bias, module.block)
    return out.reshape(*x.shape[:-1], module.out_features)


def scaled_mm_serves(x: torch.Tensor, module: Fp8Linear) -> bool:
    """Whether `scaled_mm_linear` can run x: CUDA bfloat16, at least SCALED_MM_MIN_ROWS rows, per-channel
    scales, both weight dimensions multiples of 16."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and module.block is None
            and x.numel() >= SCALED_MM_MIN_ROWS * module.in_features
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)  # _scaled_mm's alignment


def scaled_mm_linear(x: torch.Tensor, module: Fp8Linear) -> torch.Tensor:
    """W8A8 on CUDA: x quantized per token, `torch._scaled_mm` with row-wise scales, bfloat16 out."""
    out = scaled_mm(x.reshape(-1, module.in_features), module.weight, module.weight_scale, module.bias)
    return out.reshape(*x.shape[:-1], module.out_features)


def scaled_mm(rows: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """`scaled_mm_linear` for 2-D rows and a bare E4M3 weight [N, K] with per-channel scales [N, 1]; the bias
    is added in `_scaled_mm`'s epilogue to the float32 product, so the output is rounded once."""
    xq, x_scale = quantize_activations(rows)
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.reshape(1, -1),
                            bias=None if bias is None else bias.to(rows.dtype),  # _scaled_mm takes it in out_dtype
                            out_dtype=rows.dtype)


def quantize_activations(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_channel(rows)` for 2-D activation rows: the same bits in one Triton launch
    (`mstar.kernels.fp8_quant.quantize_rows`) where the fused kernels serve rows, since the PyTorch formula
    is seven kernels through float32 copies of the activations; else that formula."""
    if FUSED.ops_for(rows) is None:
        return quantize_per_channel(rows)
    from mstar.kernels.fp8_quant import quantize_rows

    return _QUANTIZE_ROWS.run(lambda: quantize_rows(rows if rows.stride(-1) == 1 else rows.contiguous()),
                              lambda: quantize_per_channel(rows))


def w8a8_reference(x: torch.Tensor, module: Fp8Linear) -> torch.Tensor:
    """The CPU emulation of `scaled_mm_linear`: both operands dequantized, the product and the bias summed in
    float32, then rounded once to x's dtype, as `_scaled_mm` adds the bias in its epilogue."""
    rows = x.reshape(-1, module.in_features)
    xq, x_scale = quantize_per_channel(rows)
    out = F.linear(dequantize(xq, x_scale, None), dequantize(module.weight, module.weight_scale, module.block))
    if module.bias is not None:
        out = out + module.bias.to(x.dtype).float()  # `scaled_mm` hands _scaled_mm the bias in x's dtype
    return out.to(x.dtype).reshape(*x.shape[:-1], module.out_features)


def method_block(method: str) -> tuple[int, int] | None:
    """The block shape of a quantization setting (None: per output channel); ValueError naming the valid ones."""
    if method not in METHODS:
        raise ValueError(f"quantization {method!r}: use one of {sorted(METHODS)}")
    return METHODS[method]


def quantize_linears(module: nn.Module, block: tuple[int, int] | None,
                     only: set[str] | None = None) -> list[str]:
    """Replace every nn.Linear inside `module` (or only those named in `only`, relative to `module`) by
    `Fp8Linear.from_linear`; the names replaced. A weight shared with another module (a tied head) is
    left alone, since quantizing it would change the other user too."""
    done = quantizable_linears(module, only)
    for name in done:
        parent, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, attr,
                Fp8Linear.from_linear(module.get_submodule(name), block))
    return done


def quantizable_linears(module: nn.Module, only: set[str] | None = None) -> list[str]:
    """The nn.Linear layers inside `module` (or those of `only`) whose weight no other module shares."""
    shared = _shared_weights(module)
    return [name for name, child in module.named_modules()
            if isinstance(child, nn.Linear) and (only is None or name in only) and id(child.weight) not in shared]


def empty_fp8_decoder(module: nn.Module, block: tuple[int, int] | None) -> list[str]:
    """What `quantize_linears(module, block)` would swap, swapped for uninitialised `Fp8Linear`s instead: for a
    module built on the meta device, so that loading (`load_named_tensors`, `fill_dummy_weights`) quantizes
    each layer as its weight arrives and no full-precision copy is made; the names swapped."""
    names = quantizable_linears(module)
    empty_fp8_linears(module, set(names), block)
    return names


def empty_fp8_linears(module: nn.Module, names: set[str], block: tuple[int, int] | None) -> None:
    """Replace the nn.Linear layers `names` (relative to `module`) by uninitialised `Fp8Linear`s of `block`
    scales, to load an FP8 checkpoint into; ValueError for a name that is not an nn.Linear."""
    for name in sorted(names):
        child = module.get_submodule(name)
        if not isinstance(child, nn.Linear):
            raise ValueError(f"{name} is a {type(child).__name__}, not a linear layer; it cannot hold FP8 weights")
        parent, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, attr,
                Fp8Linear(child.in_features, child.out_features, child.bias is not None, block,
                          child.weight.dtype, child.weight.device))


def _shared_weights(module: nn.Module) -> set[int]:
    """ids of parameters reachable under more than one name (tied weights)."""
    seen: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}
