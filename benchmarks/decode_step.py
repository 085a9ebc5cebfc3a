"""Decode step time of the autoregressive engine on one GPU, against HF transformers and the weight-read floor.

Model: a Llama with the shape of Orpheus-3B (hidden 3072, 28 layers, 24 heads, 8 KV heads, FFN 8192,
vocab 156,940, tied embeddings; 3.3B parameters), bf16, seeded random weights. For each batch size B:
B prompts of --prompt-len random tokens, --new-tokens tokens each, greedy, eos ignored.

- mstar: `AutoregressiveEngine` driven directly (each prompt one engine-loop item, as a decode walk
  hands it over: the engine appends its samples). Decode ms/step = wall time of all decode steps / their count
  (the prefill step is timed separately); it includes the engine's host work (scheduling, metadata,
  sampling, the one host sync) and the CUDA-graph replay.
- --quantization: each listed variant in turn, in the same run on the same card: `none` (bf16) and/or
  `fp8` / `fp8_block` (every decoder linear E4M3, quantized on load from the same seeded bf16 weights;
  the tied embedding/head and norms stay bf16, as `--quantization` serves them). `fp8_head` is `fp8`
  with the output head in FP8 too, untied from the embedding: a benchmark-only variant that shows what
  the head's bytes cost (the served setting keeps the head bf16 until its accuracy is measured). Each row names its
  variant; an FP8 row also gives its ms/step over the bf16 floor and over bf16's ms/step at that batch
  (when `none` ran too), and the variant lists what warm-up timing chose for its linears
  (`timed_choices`: per shape up to 64 rows, the FP8 GEMV, the skinny GEMM's tl.dot kernel on the E4M3
  weight or, from 16 rows, `_scaled_mm`; the fused SiLU down projection or not).
- transformers: `generate` on the same shapes (its default cache), bf16 only; decode ms/step =
  (time of generate with N new tokens - time with 1 new token) / (N - 1).
- floor: bytes of the weights a step reads (all, a tied embedding once, an untied one not at all) / copy
  bandwidth, where the bandwidth is (read + written bytes) / time of a
  2 GiB device-to-device copy measured in the same run. `floor_ms` is the bf16 model's (the yardstick
  of #42's "at most 0.65x the bf16 floor"); each variant also has its own (its weight bytes).

    python3 benchmarks/decode_step.py [--batch-sizes 1 8 16 32 64] [--new-tokens 256] \
        [--quantization none fp8] [--out benchmarks/results/decode_step_h200.json] [--skip-hf]

bf16 against FP8 at batch 1 / 16 / 64 (#42's decode figure), one command:

    python3 benchmarks/decode_step.py --skip-hf --batch-sizes 1 16 64 --quantization none fp8 fp8_head \
        --out benchmarks/results/decode_step_fp8_h100.json

Measures, asserts nothing. Needs a CUDA GPU; --quick runs a 2-layer model of the same structure on the
CPU for a few tokens (a smoke test of the script: its times mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from mstar.config import CudaGraphConfig, KVCacheConfig  # noqa: E402
from mstar.engines.autoregressive.engine import AutoregressiveEngine  # noqa: E402
from mstar.engines.base import LoopSpec, StepItem  # noqa: E402
from mstar.layers.fp8 import Fp8Linear  # noqa: E402
from mstar.layers.linear import SKINNY  # noqa: E402
from mstar.models.common.loading import fill_dummy_weights  # noqa: E402
from mstar.models.llama.config import LlamaConfig  # noqa: E402
from mstar.models.llama.model import build_model  # noqa: E402
from mstar.models.llama.weights import quantize_decoder  # noqa: E402

ORPHEUS_3B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 156940, "hidden_size": 3072,
    "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
# --quick: the same structure, small enough for a CPU smoke run
TINY = {**ORPHEUS_3B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
VARIANTS = ("none", "fp8", "fp8_block", "fp8_head")



def _sig(ms: float) -> float:
    """Four significant digits: a tiny --quick model's floor is far below a millisecond."""
    return float(f"{ms:.4g}")

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Bytes per second moved (read + written) by a large device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    elapsed = (time.perf_counter() - start) / iters
    del src, dst
    return 2 * nbytes / elapsed


def make_engine(model, device: torch.device, max_batch: int, max_len: int, backend: str,
                graphs: bool) -> AutoregressiveEngine:
    pages = max_batch * (-(-max_len // 16) + 1) + 64
    kv = KVCacheConfig(max_num_pages=pages, page_size=16, attention_backend=backend)
    return AutoregressiveEngine(model, kv, device, max_num_seqs=max_batch, max_batch_tokens=8192,
                                max_model_len=max_len + 16, enable_prefix_caching=False,
                                cuda_graphs=CudaGraphConfig(enabled=graphs, max_batch_size=max_batch))


def run_engine(engine: AutoregressiveEngine, prompts: torch.Tensor, new_tokens: int, tag: str) -> dict:
    """Prefill all prompts, then decode until every sequence has `new_tokens`, each request one engine loop
    as a decode walk runs; per-step wall times."""
    options = {"temperature": 0.0, "ignore_eos": True, "max_tokens": new_tokens}
    for i, p in enumerate(prompts):
        engine.submit(StepItem(f"{tag}-{i}", "gen", "llm", {"input_ids": p}, options, loop=LoopSpec(new_tokens)))
    sync(engine.device)
    start = time.perf_counter()
    results = []
    while len(results) < len(prompts):  # prefill (maybe several chunked steps)
        results += engine.step()
    prefill_s = time.perf_counter() - start
    step_times, tokens = [], {r.request_id: [int(r.outputs["token"])] for r in results}
    while engine.has_work():
        t0 = time.perf_counter()
        done = engine.step()
        step_times.append(time.perf_counter() - t0)
        for r in done:
            tokens[r.request_id].append(int(r.outputs["token"]))
    total = sum(step_times)
    return {"prefill_ms": 1e3 * prefill_s, "decode_steps": len(step_times),
            "decode_ms_per_step": 1e3 * total / len(step_times),
            "decode_ms_p50": 1e3 * statistics.median(step_times),
            "tokens_per_s": len(prompts) * len(step_times) / total,
            "tokens": [tokens[f"{tag}-{i}"] for i in range(len(prompts))]}


def run_hf(hf_model, prompts: torch.Tensor, new_tokens: int) -> dict:
    def generate(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf_model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    generate(2)  # warm-up
    one = generate(1)
    full = generate(new_tokens)
    step = (full - one) / (new_tokens - 1)
    return {"decode_ms_per_step": 1e3 * step, "tokens_per_s": prompts.shape[0] / step, "generate_s": full}


def build_hf(config: dict, device: torch.device):
    import transformers

    hf_config = transformers.LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures",)})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):  # built in place: buffers such as the rotary frequencies are computed
            model = transformers.LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(previous)
    fill_dummy_weights(model, seed=0)
    model.generation_config.eos_token_id = None
    return model.eval()


def read_parameters(model) -> list[tuple[str, torch.Tensor]]:
    """The parameters a decode step reads whole: all of them (a tied weight once), but the embedding
    table when it is not the output head too (a step gathers a row of it)."""
    embedding = model.model.embed_tokens.weight
    return [(name, p) for name, p in model.named_parameters()
            if p is not embedding or model.lm_head.weight is embedding]


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads, as stored."""
    return sum(p.numel() * p.element_size() for _, p in read_parameters(model))


def bf16_weight_bytes(model) -> int:
    """Bytes of the same weights in bf16: every parameter at 2 bytes, FP8 scales left out."""
    return 2 * sum(p.numel() for name, p in read_parameters(model) if not name.endswith("weight_scale"))


def build_variant(config: LlamaConfig, method: str, device: torch.device):
    """The Orpheus-shaped model with seeded dummy bf16 weights, its decoder linears quantized unless `none`;
    `fp8_head` also the output head, untied from the embedding (which stays bf16)."""
    model = build_model(config, torch.bfloat16, device)
    fill_dummy_weights(model, seed=0)
    if method != "none":
        quantize_decoder(model, "fp8" if method == "fp8_head" else method)
    if method == "fp8_head":
        model.lm_head = Fp8Linear.from_linear(model.lm_head, None)
    return model


def run_variant(method: str, args: argparse.Namespace, config: LlamaConfig, device: torch.device,
                bandwidth: float) -> tuple[dict, list[dict]]:
    """Build, measure every batch size, free: (the variant's weights, floors and engine facts; its rows)."""
    model = build_variant(config, method, device)
    nbytes, bf16_bytes = weight_bytes(model), bf16_weight_bytes(model)
    bf16_floor_ms = 1e3 * bf16_bytes / bandwidth
    info = {"weight_bytes": nbytes, "weight_gb": round(nbytes / 1e9, 3), "floor_ms": _sig(1e3 * nbytes / bandwidth),
            "bf16_floor_ms": _sig(bf16_floor_ms)}
    print(f"{method}: weights {nbytes / 1e9:.2f} GB, floor {info['floor_ms']:.3f} ms (bf16 {bf16_floor_ms:.3f} ms)",
          flush=True)
    max_batch = max(args.batch_sizes)
    t0 = time.perf_counter()
    engine = make_engine(model, device, max_batch, args.prompt_len + args.new_tokens, args.backend,
                         not args.no_graphs and device.type == "cuda")
    info.update(engine_setup_s=round(time.perf_counter() - t0, 1), attention_backend=type(engine.runner.attn).__name__)
    print(f"engine ready in {info['engine_setup_s']:.1f} s (attention {info['attention_backend']}, graphs "
          f"{engine.runner.graphs.sizes if engine.runner.graphs else None})", flush=True)
    hf_model = None if args.skip_hf or method != "none" or device.type != "cuda" else build_hf(ORPHEUS_3B, device)
    rows = []
    for bs in args.batch_sizes:
        prompts = torch.randint(0, config.vocab_size, (bs, args.prompt_len), generator=torch.Generator().manual_seed(bs))
        run_engine(engine, prompts[:, :8], 4, f"warm{bs}")  # warm-up at this batch size
        ours = run_engine(engine, prompts, args.new_tokens, f"b{bs}")
        row = {"quantization": method, "batch": bs, "mstar_ms_per_step": round(ours["decode_ms_per_step"], 3),
               "mstar_ms_p50": round(ours["decode_ms_p50"], 3), "mstar_tok_s": round(ours["tokens_per_s"], 1),
               "mstar_prefill_ms": round(ours["prefill_ms"], 1), "floor_ms": _sig(bf16_floor_ms),
               "over_bf16_floor": round(ours["decode_ms_per_step"] / bf16_floor_ms, 3)}
        if hf_model is not None:
            hf = run_hf(hf_model, prompts.to(device), args.new_tokens)
            row.update(hf_ms_per_step=round(hf["decode_ms_per_step"], 2), hf_tok_s=round(hf["tokens_per_s"], 1))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if method != "none":
        info["timed_choices"] = fp8_choices()
    del engine, model, hf_model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info, rows


def fp8_choices() -> list[dict]:
    """What warm-up timing chose for FP8 linears so far: the kernel of each linear (`layers.linear.FP8_KERNELS`:
    gemv, skinny_dot or scaled_mm; up to 64 rows) and the fused SiLU down projection over SiLU + the down
    projection's kernel (up to 4 rows), per (rows bucket, N, K)."""
    out = []
    for key, chosen in SKINNY.decisions.items():
        if key[0] == "fp8":  # ("fp8", block, whether _scaled_mm serves, rows bucket, N, K, ...)
            out.append({"choice": "fp8_kernel", "m_bucket": key[3], "n": key[4], "k": key[5], "won": chosen})
        elif key[0] == "fp8_silu_and_mul":
            out.append({"choice": "fused_silu_down", "m_bucket": key[2], "n": key[3], "k": key[4], "won": chosen})
    return out


def against_bf16(rows: list[dict]) -> None:
    """Add to each quantized row its ms/step over bf16's at the same batch, where bf16 ran."""
    bf16 = {r["batch"]: r["mstar_ms_per_step"] for r in rows if r["quantization"] == "none"}
    for row in rows:
        if row["quantization"] != "none" and row["batch"] in bf16:
            row["over_bf16_step"] = round(row["mstar_ms_per_step"] / bf16[row["batch"]], 3)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--quantization", nargs="+", default=["none"], choices=VARIANTS,
                        help="variants measured one after another in this run: none (bf16), fp8, fp8_block")
    parser.add_argument("--backend", default="auto", help="kv_cache.attention_backend")
    parser.add_argument("--no-graphs", action="store_true", help="run decode eagerly (no CUDA graphs)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a 2-layer model on the CPU, few tokens (smoke test)")
    parser.add_argument("--out", default="benchmarks/results/decode_step_h200.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_len, args.new_tokens, args.skip_hf = 8, 4, True
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cpu" if args.quick else "cuda")
    torch.manual_seed(0)
    config = LlamaConfig.from_hf(TINY if args.quick else ORPHEUS_3B)
    bandwidth = copy_bandwidth(device, nbytes=(1 << 20) if args.quick else 2 << 30)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    variants, rows = {}, []
    for method in dict.fromkeys(args.quantization):
        variants[method], got = run_variant(method, args, config, device, bandwidth)
        rows += got
    against_bf16(rows)
    first = next(iter(variants.values()))
    result = {
        "benchmark": "decode_step", "command": "python3 " + " ".join(sys.argv if argv is None else ["decode_step.py", *argv]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
        "model": f"Llama, {'tiny (--quick)' if args.quick else 'Orpheus-3B'} shape, dummy weights; "
                 f"quantization {', '.join(variants)}",
        "weight_gb": first["weight_gb"], "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3),
        "floor_ms": first["bf16_floor_ms"], "variants": variants,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "engine_setup_s": first["engine_setup_s"],
        "attention_backend": first["attention_backend"], "cuda_graphs": not args.no_graphs and device.type == "cuda",
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
