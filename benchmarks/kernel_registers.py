"""Registers, spills, load widths and in-loop layout conversions of the decode GEMV (mstar/kernels/gemv.py,
or with --fp8 mstar/kernels/fp8_gemv.py) per launch config, from
an offline compile for an H100/H200 (sm_90a): no GPU needed, only triton's bundled ptxas. `skinny_report`
does the same for the skinny GEMM's tl.dot kernel with bf16 or E4M3 weights (used by the CPU tests).

A GEMV at a few rows is bandwidth-bound; what limits its bandwidth is the bytes each SM keeps in flight,
i.e. how many threads fit (registers per thread) times the bytes each loads per chunk. This shows the
register cost of a config before any device time is spent on it. Pointers and the shape arguments are
compiled as 16-byte aligned, as Triton specialises them at launch for these shapes.

    python3 benchmarks/kernel_registers.py                      # the M = 1 and M = 4 configs below
    python3 benchmarks/kernel_registers.py --configs 4,8,1024,4,8   # block_m,block_n,block_k,warps,fold_k
    python3 benchmarks/kernel_registers.py --fp8 --configs 1,4,1024,2,1   # the FP8-weight GEMV
    python3 benchmarks/kernel_registers.py --rotary   # V-JEPA 2's pair rotary kernel

`rotary_report` compiles V-JEPA 2's pair rotary (mstar/kernels/fused_ops.py) the same way and counts its
global loads and stores by width: whether it moves x in vectors or in scalar gathers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mstar.kernels import fp8_gemv, fused_ops, gemv, skinny_gemm  # noqa: E402

# (block_m, block_n, block_k, num_warps, fold_k): the tuned M = 1 qkv config, the M = 4 sweep's best
# and its folded variants
DEFAULT = ["1,2,1024,4,1", "4,4,1024,4,1", "4,4,1024,4,8", "4,8,1024,4,8", "4,2,1024,4,1", "4,2,1024,4,8"]
_ALIGNED = ("x_ptr", "w_ptr", "s_ptr", "b_ptr", "out_ptr", "ws_ptr", "lock_ptr", "N", "K", "stride_xm", "stride_wn",
            "gate_offset")


def compile_report(block_m: int, block_n: int, block_k: int, warps: int, fold_k: int, k: int = 3072,
                   stages: int = 2, fp8: bool = False) -> dict:
    """Compile the plain GEMV (no bias or gate; one split) for sm_90a and read ptxas' report; `fp8`: the
    FP8-weight GEMV (mstar/kernels/fp8_gemv.py, per-channel scales) instead."""
    if fp8:
        sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16",
               "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
               "gate_offset": "i32"}
        const = dict(GATED=False, HAS_BIAS=False, BLOCK_SCALES=False, SCALE_BN=1, SCALE_BK=1)
    else:
        sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
               "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
               "gate_offset": "i32"}
        const = dict(HAS_BIAS=False, GATED=False, SPLIT_K=1)
    # both kernels load 8 values of a weight row a thread (16 bytes of bf16, 8 of E4M3), as x's 16-byte loads
    const.update(EVEN_K=True, K_ITERS=k // block_k, BROADCAST_X=block_k >= 8 * 32 * warps,
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FOLD_K=fold_k, PDL=True)
    names = list(sig)
    sig.update({name: "constexpr" for name in const})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in _ALIGNED if n in names}
    src = ASTSource(fn=fp8_gemv._fp8_gemv_kernel if fp8 else gemv._gemv_kernel, signature=sig, constexprs=const,
                    attrs=attrs)
    kernel, regs, spills = _compile_sm90(src, warps, stages)
    ptx = kernel.asm["ptx"]
    threads = 32 * warps
    blocks = min(65536 // (regs * threads), 2048 // threads, 32)  # per SM: registers, threads, blocks
    return {"config": dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=warps, fold_k=fold_k,
                           num_stages=stages, k=k, fp8=fp8),
            "registers": regs, "spill_bytes": spills, "loads": sorted(set(re.findall(r"ld\.global[.a-z0-9]*", ptx))),
            "shuffles": ptx.count("shfl.sync"),  # the whole kernel: the final reduction has its own
            "loop_layout_conversions": loop_layout_conversions(kernel.asm["ttgir"]),
            "blocks_per_sm_by_registers": blocks,
            "weight_bytes_per_sm_per_chunk": blocks * block_n * block_k * (1 if fp8 else 2)}


def skinny_report(block_m: int, block_n: int, block_k: int, warps: int, stages: int, k: int = 3072, split: int = 1,
                  fp8: bool = False, block: tuple[int, int] | None = None) -> dict:
    """Compile the skinny GEMM's tl.dot kernel (mstar/kernels/skinny_gemm.py; bias, bf16 x) for sm_90a, with
    bf16 weights or `fp8` E4M3 ones (per-channel scales, or `block` scales), and read ptxas' report: registers,
    spills, the MMA instructions (their operand types) and the global loads."""
    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv" if fp8 else "*bf16", "s_ptr": "*fp32", "b_ptr": "*bf16",
           "out_ptr": "*bf16", "ws_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "stride_sn": "i32"}
    scales = "none" if not fp8 else "channel" if block is None else "block"
    const = dict(HAS_BIAS=True, TO_WORKSPACE=split > 1, EVEN_K=True, DOT_FP32=False, SCALES=scales,
                 SCALE_BN=(block or (1, 1))[0], SCALE_BK=(block or (1, 1))[1], K_ITERS=k // split // block_k,
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PDL=True)
    names = list(sig)
    sig.update({name: "constexpr" for name in const})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in _ALIGNED if n in names}
    src = ASTSource(fn=skinny_gemm._skinny_kernel, signature=sig, constexprs=const, attrs=attrs)
    kernel, regs, spills = _compile_sm90(src, warps, stages)
    ptx = kernel.asm["ptx"]
    return {"config": dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages,
                           k=k, split_k=split, fp8=fp8, block=block),
            "registers": regs, "spill_bytes": spills,
            "mma": sorted(set(re.findall(r"(?:wgmma\.mma_async|mma)\.sync\.aligned\.[a-z0-9.]+", ptx))),
            "loads": sorted(set(re.findall(r"(?:ld\.global|cp\.async\.[a-z]+\.shared\.global)[.a-z0-9]*", ptx)))}


def rotary_report(copy: bool, heads: int = 16, dim: int = 64) -> dict:
    """Compile V-JEPA 2's pair rotary (`rotary_pairs`' kernel) for sm_90a at bf16 x, float32 tables and `heads`
    heads of `dim`, as its launcher in mstar/kernels/fused_ops.py configures it; `copy`: with values carried.
    Registers, spills, shared memory, layout conversions and the count of each global load and store width."""
    block_t, block_h, block_d = fused_ops._PAIR_TOKENS, fused_ops._head_block(heads), triton.next_power_of_2(dim)
    const = dict(DIM=dim, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_T=block_t, COPY=copy, PDL=True)
    sig = {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*bf16", "c_ptr": "*bf16",
           "c_out_ptr": "*bf16", "tokens": "i32", "num_heads": "i32"}
    warps, fn = fused_ops._rows_warps(block_t, block_h, block_d), fused_ops._pair_rows_kernel
    strides = ("x_stride_b", "x_stride_t", "x_stride_h", "cs_stride_b", "cs_stride", "out_stride_b", "out_stride_t",
               "out_stride_h")
    sig.update(dict.fromkeys(strides, "i32"))
    names = list(sig)
    sig.update({name: "constexpr" for name in const})
    # pointers and strides (multiples of a 64-wide head; the tables' batch stride is 0) as launches specialise them
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in ("tokens", "num_heads")}
    kernel, regs, spills = _compile_sm90(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), warps, 1)
    widths = re.findall(r"(?:ld|st)\.global[.a-z0-9]*", kernel.asm["ptx"])
    return {"config": dict(copy=copy, tokens_per_program=block_t, heads=heads, dim=dim, num_warps=warps),
            "registers": regs, "spill_bytes": spills, "shared_bytes": kernel.metadata.shared,
            "layout_conversions": kernel.asm["ttgir"].count("ttg.convert_layout"),
            "global_accesses": {w: widths.count(w) for w in sorted(set(widths))}}


def _compile_sm90(src: ASTSource, warps: int, stages: int):
    """(the compiled kernel, registers, spill bytes) of `src` for sm_90a, from triton's bundled ptxas."""
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        Path(path).write_text(kernel.asm["ptx"])
        out = subprocess.run([str(ptxas), "--gpu-name", "sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True)
    report = out.stdout + out.stderr
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    return kernel, regs, int(re.search(r"(\d+) bytes spill stores", report).group(1))


def loop_layout_conversions(ttgir: str) -> int:
    """How many `ttg.convert_layout` ops sit inside an scf.for of the TTGIR: each moves a tile through
    shared memory on every K chunk."""
    depth, count = 0, 0
    for line in ttgir.splitlines():
        text = line.strip()
        if "scf.for" in text:
            depth += 1
        elif text.startswith("scf.yield"):
            depth -= 1
        elif depth and "ttg.convert_layout" in text:
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=DEFAULT, help="block_m,block_n,block_k,num_warps,fold_k")
    parser.add_argument("--fp8", action="store_true", help="the FP8-weight GEMV (mstar/kernels/fp8_gemv.py)")
    parser.add_argument("--rotary", action="store_true", help="V-JEPA 2's pair rotary instead (16 heads of 64)")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = parser.parse_args()
    rows = []
    if args.rotary:
        for copy in (False, True):
            rows.append(rotary_report(copy))
            print(json.dumps(rows[-1]), flush=True)
        args.configs = []
    for spec in args.configs:
        row = compile_report(*(int(v) for v in spec.split(",")), fp8=args.fp8)
        rows.append(row)
        c = row["config"]
        print(f"M<={c['block_m']} N-block {c['block_n']} K-block {c['block_k']} warps {c['num_warps']} "
              f"fold {c['fold_k']}: {row['registers']} registers, {row['spill_bytes']} B spilled, "
              f"{row['blocks_per_sm_by_registers']} blocks/SM, {row['weight_bytes_per_sm_per_chunk']} weight B/SM "
              f"per chunk, loads {row['loads']}, {row['loop_layout_conversions']} layout conversions in the K loop",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python3 " + " ".join(sys.argv), "triton": triton.__version__,
                                              "target": "sm_90a (offline compile, no GPU)", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
