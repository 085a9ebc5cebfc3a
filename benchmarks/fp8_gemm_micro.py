"""Large-M linears, bf16 against the forms of W8A8 FP8: Wan2.2's DiT block at full size (832x480x33).

Wan2.2-TI2V-5B's DiT runs 2 x 3,510 = 7,020 token rows (two guidance branches) through six linears a
block, 30 blocks a step: self-attention qkv (9216 x 3072), its out projection, cross-attention q and out
(3072 x 3072 each), FFN in (14336 x 3072, GELU after) and FFN out (3072 x 14336). Per shape, GPU
microseconds per call of:

  bf16            F.linear with bias (nn.Linear; FFN in: the GELU in cuBLASLt's epilogue, as `linear_gelu`)
  fp8_formula     the W8A8 path as it was: `quantize_per_channel` in PyTorch (float32 temporaries),
                  `torch._scaled_mm`, then the bias added by a separate kernel (FFN in: then F.gelu)
  fp8             the previous W8A8 path: `kernels/fp8_quant.quantize_rows`, `_scaled_mm`, then a
                  separate bias add (FFN in: then F.gelu)
  fp8_bias        the W8A8 path as `layers.fp8.scaled_mm` runs it: the same with the bias passed to
                  `_scaled_mm` (added in its epilogue: one rounding)
  fp8_bias_fast   the same with `use_fast_accum=True` (Hopper's FP8 accumulation without periodic
                  promotion to float32: faster, less accurate)
  mm_only         `_scaled_mm` alone on activations quantized beforehand: the ceiling of any W8A8 form
  quant_formula / quant_kernel   the activation quantization alone, PyTorch formula / Triton kernel

`step_ms` sums a block's six linears (3 of the 3072 x 3072 shape) times 30 blocks: the linears' share of
one denoising step, comparable with `wan_bench.py`'s s_per_step. Each FP8 form's `max_err` is its largest
difference from `w8a8_reference` (float32 product of the dequantized operands) relative to that
reference's largest magnitude; a form this torch build refuses is reported as `<form>_error`. Timings: `mstar.kernels.timing.graph_time_us` (back-to-back calls in a CUDA
graph, each on its own copy of the weight). Measures, asserts nothing.

    python3 benchmarks/fp8_gemm_micro.py [--rows 7020] [--out benchmarks/results/fp8_gemm_micro_h100.json]
    TRITON_INTERPRET=1 python3 benchmarks/fp8_gemm_micro.py --quick   # CPU: each form runs once, no timings

--quick: 64 rows and every dimension divided by 16, on CPU when there is no GPU (the Triton kernel under
TRITON_INTERPRET=1): checks the forms agree, times nothing, writes no file unless --out.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_io import write_results  # noqa: E402
from mstar.kernels.fp8_quant import quantize_rows  # noqa: E402
from mstar.layers.fp8 import Fp8Linear, quantize_per_channel, w8a8_reference  # noqa: E402

# name: (N, K, calls a block, GELU after)
WAN_BLOCK = {"qkv": (9216, 3072, 1, False), "attn_out": (3072, 3072, 3, False),
             "ffn_in": (14336, 3072, 1, True), "ffn_out": (3072, 14336, 1, False)}
WAN_BLOCKS = 30
WAN_ROWS = 2 * 3510


def _epilogue(out: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    out = out if bias is None else out + bias
    return F.gelu(out, approximate="tanh") if gelu else out


def _scaled(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, **kwargs) -> torch.Tensor:
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.reshape(1, -1), out_dtype=torch.bfloat16, **kwargs)


def forms(x: torch.Tensor, layer: Fp8Linear, dense: torch.Tensor, gelu: bool) -> dict:
    """name -> fn(weight) for each form (module docstring); the weight argument is E4M3 except for bf16."""
    bias, ws = layer.bias, layer.weight_scale
    xq, xs = quantize_rows(x)

    def bf16(w):
        if gelu:
            return torch._addmm_activation(bias, x, w.t(), use_gelu=True)
        return F.linear(x, w, bias)

    def fp8_formula(w):
        return _epilogue(_scaled(*quantize_per_channel(x), w, ws), bias, gelu)

    def fp8(w):
        return _epilogue(_scaled(*quantize_rows(x), w, ws), bias, gelu)

    def fp8_bias(w, fast=False):
        return _epilogue(_scaled(*quantize_rows(x), w, ws, bias=bias, use_fast_accum=fast), None, gelu)

    return {"bf16": (bf16, dense), "fp8_formula": (fp8_formula, layer.weight), "fp8": (fp8, layer.weight),
            "fp8_bias": (fp8_bias, layer.weight), "fp8_bias_fast": (partial(fp8_bias, fast=True), layer.weight),
            "mm_only": (lambda w: _scaled(xq, xs, w, ws), layer.weight),
            "quant_formula": (lambda w: quantize_per_channel(x), layer.weight),
            "quant_kernel": (lambda w: quantize_rows(x), layer.weight)}


def shape_row(name: str, rows: int, n: int, k: int, gelu: bool, device: torch.device, timed: bool, replays: int) -> dict:
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(linear, None)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    reference = w8a8_reference(x, layer).float()
    reference = F.gelu(reference, approximate="tanh") if gelu else reference
    row = {"shape": name, "m": rows, "n": n, "k": k, "gelu": gelu}
    for form, (fn, weight) in forms(x, layer, linear.weight.detach(), gelu).items():
        try:
            if form in ("bf16", "fp8_formula", "fp8", "fp8_bias", "fp8_bias_fast"):
                err = (fn(weight).float() - reference).abs().max() / reference.abs().max()
                row[f"{form}_max_err"] = round(float(err), 5)
            if timed:
                from mstar.kernels.timing import graph_time_us

                row[f"{form}_us"] = round(graph_time_us(fn, weight, replays=replays), 1)
        except RuntimeError as exc:  # e.g. a _scaled_mm option this torch build refuses: the other forms still run
            row[f"{form}_error"] = str(exc).splitlines()[0][:200]
    if timed:
        flops = 2 * rows * n * k
        row |= {f"{form}_tflops": round(flops / row[f"{form}_us"] / 1e6, 1)
                for form in ("bf16", "fp8", "fp8_bias", "fp8_bias_fast", "mm_only") if f"{form}_us" in row}
    return row


def step_ms(rows: list[dict]) -> dict:
    """Each timed form's linears summed over one step: a block's calls of each shape, times 30 blocks."""
    forms_timed = [key[:-3] for key in rows[0] if key.endswith("_us") and all(key in r for r in rows)]
    return {form: round(WAN_BLOCKS * sum(r[f"{form}_us"] * WAN_BLOCK[r["shape"]][2] for r in rows) / 1e3, 2)
            for form in forms_timed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=WAN_ROWS, help="activation rows (tokens x guidance branches)")
    parser.add_argument("--replays", type=int, default=5, help="timed replays per graph (median kept)")
    parser.add_argument("--quick", action="store_true", help="64 rows, dimensions / 16, CPU if no GPU; no timings")
    parser.add_argument("--out", default=None, help="default benchmarks/results/fp8_gemm_micro.json (quick: none)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timed = device.type == "cuda" and not args.quick
    rows_n, div = (64, 16) if args.quick else (args.rows, 1)
    rows = []
    for name, (n, k, _, gelu) in WAN_BLOCK.items():
        row = shape_row(name, rows_n, n // div, k // div, gelu, device, timed, args.replays)
        rows.append(row)
        print(" ".join(f"{key}={val}" for key, val in row.items()), flush=True)
    doc = {"benchmark": "fp8_gemm_micro", "command": " ".join(["python3", *sys.argv]), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "rows": rows}
    if timed:
        doc["step_ms"] = step_ms(rows)
        print("linears of one step (ms):", " ".join(f"{k}={v}" for k, v in doc["step_ms"].items()), flush=True)
    path = write_results(doc, args.out, args.quick, "fp8_gemm_micro")
    if path is not None:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
