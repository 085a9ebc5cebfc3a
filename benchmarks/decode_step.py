"""Decode step time of the autoregressive engine on one GPU, against HF transformers and the weight-read floor.

Model: a Llama with the shape of Orpheus-3B (hidden 3072, 28 layers, 24 heads, 8 KV heads, FFN 8192,
vocab 156,940, tied embeddings; 3.3B parameters), bf16, seeded random weights. For each batch size B:
B prompts of --prompt-len random tokens, --new-tokens tokens each, greedy, eos ignored.

- mstar: `AutoregressiveEngine` driven directly (each prompt one engine-loop item, as a decode walk
  hands it over: the engine appends its samples). Decode ms/step = wall time of all decode steps / their count
  (the prefill step is timed separately); it includes the engine's host work (scheduling, metadata,
  sampling, the one host sync) and the CUDA-graph replay.
- transformers: `generate` on the same shapes (its default cache); decode ms/step =
  (time of generate with N new tokens - time with 1 new token) / (N - 1).
- floor: weight bytes / copy bandwidth, where the bandwidth is (read + written bytes) / time of a
  2 GiB device-to-device copy measured in the same run.

    python3 benchmarks/decode_step.py [--batch-sizes 1 8 16 32 64] [--new-tokens 256] \
        [--out benchmarks/results/decode_step_h200.json] [--skip-hf]

Measures, asserts nothing. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
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
from mstar.models.common.loading import fill_dummy_weights  # noqa: E402
from mstar.models.llama.config import LlamaConfig  # noqa: E402
from mstar.models.llama.model import build_model  # noqa: E402

ORPHEUS_3B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 156940, "hidden_size": 3072,
    "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Bytes per second moved (read + written) by a large device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize(device)
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
    torch.cuda.synchronize()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--backend", default="auto", help="kv_cache.attention_backend")
    parser.add_argument("--no-graphs", action="store_true", help="run decode eagerly (no CUDA graphs)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/decode_step_h200.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    config = LlamaConfig.from_hf(ORPHEUS_3B)
    model = build_model(config, torch.bfloat16, device)
    fill_dummy_weights(model, seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once
    bandwidth = copy_bandwidth(device)
    floor_ms = 1e3 * weight_bytes / bandwidth
    print(f"weights {weight_bytes / 1e9:.2f} GB, copy bandwidth {bandwidth / 1e12:.2f} TB/s, floor {floor_ms:.3f} ms",
          flush=True)
    max_batch = max(args.batch_sizes)
    t0 = time.perf_counter()
    engine = make_engine(model, device, max_batch, args.prompt_len + args.new_tokens, args.backend,
                         not args.no_graphs)
    setup_s = time.perf_counter() - t0
    print(f"engine ready in {setup_s:.1f} s (attention {type(engine.runner.attn).__name__}, graphs "
          f"{engine.runner.graphs.sizes if engine.runner.graphs else None})", flush=True)
    hf_model = None if args.skip_hf else build_hf(ORPHEUS_3B, device)
    rows = []
    for bs in args.batch_sizes:
        prompts = torch.randint(0, config.vocab_size, (bs, args.prompt_len), generator=torch.Generator().manual_seed(bs))
        run_engine(engine, prompts[:, :8], 4, f"warm{bs}")  # warm-up at this batch size
        ours = run_engine(engine, prompts, args.new_tokens, f"b{bs}")
        row = {"batch": bs, "mstar_ms_per_step": round(ours["decode_ms_per_step"], 3),
               "mstar_ms_p50": round(ours["decode_ms_p50"], 3), "mstar_tok_s": round(ours["tokens_per_s"], 1),
               "mstar_prefill_ms": round(ours["prefill_ms"], 1), "floor_ms": round(floor_ms, 3)}
        if hf_model is not None:
            hf = run_hf(hf_model, prompts.to(device), args.new_tokens)
            row.update(hf_ms_per_step=round(hf["decode_ms_per_step"], 2), hf_tok_s=round(hf["tokens_per_s"], 1))
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "benchmark": "decode_step", "command": "python3 " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "python": platform.python_version(),
        "model": "Llama, Orpheus-3B shape, bf16, dummy weights", "weight_gb": round(weight_bytes / 1e9, 3),
        "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3), "floor_ms": round(floor_ms, 3),
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "engine_setup_s": round(setup_s, 1),
        "attention_backend": type(engine.runner.attn).__name__, "cuda_graphs": not args.no_graphs, "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
