"""FlashInferBackend with the real flashinfer on CUDA: against SDPABackend, CUDA-graph replay, the engine.

Skipped where flashinfer does not import. These are the tests that say whether the adapter is right
for FlashInfer itself (tests/unit/test_flashinfer_backend.py only checks it against a stand-in).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit import flashinfer_cases as fc
from tests.unit.paged_attention_cases import Shape, random_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
flashinfer = pytest.importorskip("flashinfer")

BF16 = Shape(hq=24, hkv=8, head_dim=128, page_size=16, num_pages=4096, max_pages_per_seq=160, dtype=torch.bfloat16)
FP16 = Shape(hq=32, hkv=8, head_dim=64, page_size=16, num_pages=1024, max_pages_per_seq=160, dtype=torch.float16)
DECODE_LENS = [1, 17, 300, 1024, 2047, 2048, 5, 64]
GPU_CASES = {
    **{f"small_{name}": case for name, case in fc.CASES.items()},
    "mixed_causal": dict(shape=BF16, seq_lens=[2048, 1500, 1000, 517, 33], query_lens=[2048, 1, 300, 17, 33]),
    "non_causal": dict(shape=BF16, seq_lens=[700, 1200], query_lens=[700, 129], causal=False),
    "sliding_window": dict(shape=BF16, seq_lens=[2000, 900, 1800], query_lens=[1000, 1, 77], window=256),
    "decode_b8": dict(shape=BF16, seq_lens=DECODE_LENS, query_lens=[1] * 8),
    "decode_window": dict(shape=BF16, seq_lens=DECODE_LENS, query_lens=[1] * 8, window=200),
    "decode_padded": dict(shape=BF16, seq_lens=[900, 3, 2000], query_lens=[1] * 3, pad_to=16,
                          warmup=(DECODE_LENS * 2, [1] * 16)),
    "fp16_mixed_gqa4": dict(shape=FP16, seq_lens=[1000, 50, 1], query_lens=[200, 1, 1]),
}


@pytest.mark.parametrize("name", list(GPU_CASES))
def test_matches_sdpa(name: str) -> None:
    case = GPU_CASES[name]
    r = fc.run_case(device="cuda", **case)
    assert r["out"] <= fc.tolerance(case["shape"].dtype, r["ref_scale"]), r
    assert r["k_cache"] == 0 and r["v_cache"] == 0 and r["pad_finite"], r


def test_decode_graph_replay_matches_sdpa() -> None:
    """Capture two layers' forwards for a padded decode batch, then re-prepare and replay other batches."""
    sdpa, fib = fc.make_pair(BF16, "cuda", num_qo_heads=BF16.hq)
    pad_to, layers = 8, (0, 1)
    static = [torch.zeros(pad_to, h, BF16.head_dim, dtype=BF16.dtype, device="cuda") for h in (24, 8, 8)]
    meta, q, k, v = random_batch(BF16, [40, 9, 1300], [1, 1, 1], "cuda", seed=3)
    fib.prepare(meta, pad_to=pad_to)
    sdpa.prepare(meta)
    for layer in layers:  # eager first: FlashInfer may load or JIT-build kernels
        fib.forward(layer, *static)
        sdpa.forward(layer, *(s[: len(meta.query_lens)] for s in static))  # the same cache writes (zeros)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fib.forward(layer, *static) for layer in layers]
    for seed, lens in ((4, [2048, 1, 700, 33, 16]), (5, [5, 17, 1999, 64, 300, 128, 1024, 2])):
        meta, q, k, v = random_batch(BF16, lens, [1] * len(lens), "cuda", seed=seed)
        for s, x in zip(static, (q, k, v)):
            s.zero_()
            s[: x.shape[0]] = x
        fib.prepare(meta, pad_to=pad_to)
        graph.replay()
        n = len(lens)
        for layer, out in zip(layers, outs):
            sdpa.prepare(meta)
            ref = sdpa.forward(layer, q, k, v)
            err = (out[:n].float() - ref.float()).abs().max().item()
            assert err <= fc.tolerance(torch.bfloat16, ref.abs().max().item()), (seed, layer, err)
        pages = sdpa.k_cache.shape[1]
        assert torch.equal(fib.k_cache[:, :pages], sdpa.k_cache)


def _checkpoint(path: Path) -> Path:
    """A random Llama with head_dim 64 (FlashInfer's smallest), saved as a HF folder."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.ndim > 1:
                param.normal_(0.0, 0.3)  # large enough that greedy text does not collapse to one token
    hf.save_pretrained(path)
    return path


def test_engine_graphs_match_eager_with_flashinfer(tmp_path) -> None:
    from mstar.engines.attention.flashinfer_backend import FlashInferBackend
    from mstar.models.llama.weights import load_model
    from tests.gpu.test_decode_graphs import engine_for, generate, prompts_of

    model = load_model(_checkpoint(tmp_path), dtype=torch.bfloat16, device=torch.device("cuda"))
    prompts, budgets = prompts_of([3, 17, 40, 9, 64]), [40, 33, 20, 7, 50]
    graphed = engine_for(model, graphs=True, backend="flashinfer")  # "auto" picks triton first (runner.py)
    assert isinstance(graphed.runner.attn, FlashInferBackend)
    assert graphed.runner.graphs is not None
    eager = engine_for(model, graphs=False, backend="flashinfer")
    assert generate(graphed, prompts, budgets) == generate(eager, prompts, budgets)
