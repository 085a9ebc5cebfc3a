"""Triton paged attention on CUDA (bf16, Llama-3B-like heads) against SDPABackend, CUDA-graph replay,
and micro-benchmarks (`benchmark_decode`, `benchmark_prefill`; `python -m tests.gpu.test_triton_attention_gpu`).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.paged_attention_cases import Shape, make_pair, random_batch, run_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = Shape(hq=24, hkv=8, head_dim=128, page_size=16, num_pages=4096, max_pages_per_seq=160,
             dtype=torch.bfloat16)
MHA = Shape(hq=8, hkv=8, head_dim=64, page_size=16, num_pages=1024, max_pages_per_seq=160, dtype=torch.bfloat16)
FP16 = Shape(hq=24, hkv=8, head_dim=128, page_size=16, num_pages=1024, max_pages_per_seq=160, dtype=torch.float16)
FP32 = Shape(hq=16, hkv=4, head_dim=128, page_size=16, num_pages=1024, max_pages_per_seq=160, dtype=torch.float32)
DECODE_LENS = [1, 17, 300, 1024, 2047, 2048, 5, 64]
CASES = {
    "mixed_causal": dict(shape=BF16, seq_lens=[2048, 1500, 1000, 517, 33],
                         query_lens=[2048, 1, 300, 17, 33]),
    "non_causal": dict(shape=BF16, seq_lens=[700, 1200], query_lens=[700, 129], causal=False),
    "sliding_window": dict(shape=BF16, seq_lens=[2000, 900, 1800], query_lens=[1000, 1, 77], window=256),
    "decode_b1_short": dict(shape=BF16, seq_lens=[100], query_lens=[1]),
    "decode_b1_long": dict(shape=BF16, seq_lens=[2048], query_lens=[1]),
    "decode_b8": dict(shape=BF16, seq_lens=DECODE_LENS, query_lens=[1] * 8),
    "decode_b40": dict(shape=BF16, seq_lens=DECODE_LENS * 5, query_lens=[1] * 40, max_num_seqs=64),
    "decode_window": dict(shape=BF16, seq_lens=DECODE_LENS, query_lens=[1] * 8, window=200),
    "decode_padded": dict(shape=BF16, seq_lens=[900, 3, 2000], query_lens=[1] * 3, pad_to=16,
                          warmup=(DECODE_LENS, [1] * 8)),
    # staged as the engine does (packed pinned inputs, one copy, buffers shared with the backend)
    "decode_staged": dict(shape=BF16, seq_lens=[900, 3, 2000], query_lens=[1] * 3, pad_to=16,
                          warmup=(DECODE_LENS, [1] * 8), staged=True),
    "mha_mixed": dict(shape=MHA, seq_lens=[1000, 50, 1], query_lens=[200, 1, 1]),
    "fp16_mixed": dict(shape=FP16, seq_lens=[1000, 50, 1], query_lens=[200, 1, 1]),
    "fp32_mixed": dict(shape=FP32, seq_lens=[1000, 50, 1], query_lens=[200, 1, 1]),
}


def _tolerance(dtype: torch.dtype, ref_scale: float) -> float:
    """Allowed max abs difference from SDPA: both round to `dtype`, sum in different orders."""
    atol, rtol = {torch.bfloat16: (2e-3, 2e-2), torch.float16: (5e-4, 5e-3), torch.float32: (1e-5, 1e-4)}[dtype]
    return atol + rtol * ref_scale


@pytest.mark.parametrize("name", list(CASES))
def test_matches_sdpa(name: str) -> None:
    r = run_case(device="cuda", **CASES[name])
    shape = CASES[name]["shape"]
    assert r["out"] <= _tolerance(shape.dtype, r["ref_scale"]), r
    assert r["k_cache"] == 0 and r["v_cache"] == 0 and r["pad_rows"] == 0, r


def test_decode_graph_replay_matches_eager() -> None:
    sdpa, tri = make_pair(BF16, "cuda")
    pad_to, layers = 8, (0, 1)
    meta, q, k, v = random_batch(BF16, [40, 9, 1300], [1, 1, 1], "cuda", seed=3)
    static = [torch.zeros(pad_to, *x.shape[1:], dtype=x.dtype, device="cuda") for x in (q, k, v)]
    for s, x in zip(static, (q, k, v)):
        s[: x.shape[0]] = x
    tri.prepare(meta, pad_to=pad_to)
    sdpa.prepare(meta)
    for layer in layers:  # warm-up compiles the kernels outside the capture
        tri.forward(layer, *static)
        sdpa.forward(layer, q, k, v)  # same cache writes on both sides
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [tri.forward(layer, *static) for layer in layers]

    for seed, lens in ((4, [2048, 1, 700, 33, 16]), (5, [5, 17, 1999, 64, 300, 128, 1024, 2])):
        meta, q, k, v = random_batch(BF16, lens, [1] * len(lens), "cuda", seed=seed)
        for s, x in zip(static, (q, k, v)):
            s.zero_()
            s[: x.shape[0]] = x
        tri.prepare(meta, pad_to=pad_to)
        graph.replay()
        replayed = [o.clone() for o in outs]
        eager = [tri.forward(layer, *static) for layer in layers]
        n = len(lens)
        for layer, r, e in zip(layers, replayed, eager):
            torch.testing.assert_close(r, e, rtol=0, atol=0)
            sdpa.prepare(meta)
            ref = sdpa.forward(layer, q, k, v)
            err = (r[:n].float() - ref.float()).abs().max().item()
            assert err <= _tolerance(torch.bfloat16, ref.abs().max().item()), err
            assert r[n:].numel() == 0 or r[n:].abs().max().item() == 0  # padded rows give zeros
        torch.testing.assert_close(tri.k_cache, sdpa.k_cache, rtol=0, atol=0)


def _time_ms(fn, iters: int = 50) -> float:
    """Mean milliseconds of `fn` on the GPU (after a warm-up call)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def benchmark_decode(batch_sizes=(1, 8, 32, 128), context_lens=(128, 512, 2048, 8192), shape: Shape = BF16,
                     num_layers: int = 28) -> list[dict]:
    """Per-layer decode attention time (store + attention + reduce), microseconds, for a CUDA graph of
    `num_layers` forwards and eagerly. Not a test: call it on the GPU box."""
    return [_decode_point(bs, ctx, shape, num_layers) for ctx in context_lens for bs in batch_sizes]


def _decode_point(bs: int, ctx: int, shape: Shape, num_layers: int, pool_bytes: int = 8 << 30) -> dict:
    from mstar.engines.attention.base import AttentionMetadata
    from mstar.engines.attention.triton_backend import TritonBackend
    from mstar.engines.base import KVLayout

    pages_per_seq = -(-ctx // shape.page_size)
    num_pages = bs * pages_per_seq
    layer_bytes = 2 * num_pages * shape.page_size * shape.hkv * shape.head_dim * shape.dtype.itemsize
    cached_layers = max(1, min(num_layers, pool_bytes // layer_bytes))  # forwards cycle over these
    layout = KVLayout(cached_layers, shape.hkv, shape.head_dim, shape.dtype)
    tri = TritonBackend(layout, num_pages, shape.page_size, "cuda", max_num_seqs=bs, max_pages_per_seq=pages_per_seq)
    tables = torch.randperm(num_pages, device="cuda").view(bs, pages_per_seq).int()
    slots = tables[:, -1].long() * shape.page_size + (ctx - 1) % shape.page_size
    tri.prepare(AttentionMetadata([1] * bs, [ctx] * bs, slots, tables), pad_to=bs)
    q, k, v = (torch.randn(bs, h, shape.head_dim, device="cuda", dtype=shape.dtype)
               for h in (shape.hq, shape.hkv, shape.hkv))

    def step() -> None:
        for i in range(num_layers):
            tri.forward(i % cached_layers, q, k, v)

    eager = _time_ms(step, iters=10)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graphed = _time_ms(graph.replay)
    return dict(batch=bs, context=ctx, graph_us_per_layer=1e3 * graphed / num_layers,
                eager_us_per_layer=1e3 * eager / num_layers, cached_layers=cached_layers)


def benchmark_prefill(lengths=(512, 2048, 8192), shape: Shape = BF16) -> list[dict]:
    """Prefill attention of one causal sequence (store + attention), eager: ms and TFLOP/s."""
    return [_prefill_point(n, shape) for n in lengths]


def _prefill_point(n: int, shape: Shape) -> dict:
    from mstar.engines.attention.base import AttentionMetadata
    from mstar.engines.attention.triton_backend import TritonBackend
    from mstar.engines.base import KVLayout

    pages = -(-n // shape.page_size)
    tri = TritonBackend(KVLayout(1, shape.hkv, shape.head_dim, shape.dtype), pages, shape.page_size, "cuda",
                        max_num_seqs=1, max_pages_per_seq=pages)
    table = torch.randperm(pages, device="cuda").int()[None]
    pos = torch.arange(n, device="cuda")
    slots = table[0, pos // shape.page_size].long() * shape.page_size + pos % shape.page_size
    tri.prepare(AttentionMetadata([n], [n], slots, table))
    q, k, v = (torch.randn(n, h, shape.head_dim, device="cuda", dtype=shape.dtype)
               for h in (shape.hq, shape.hkv, shape.hkv))
    ms = _time_ms(lambda: tri.forward(0, q, k, v), iters=20)
    flops = 2 * 2 * shape.hq * shape.head_dim * n * n / 2  # QK^T and PV, causal half
    return dict(tokens=n, ms=ms, tflops=flops / ms / 1e9)


if __name__ == "__main__":
    print(json.dumps({"decode": benchmark_decode(), "prefill": benchmark_prefill()}, indent=1))
