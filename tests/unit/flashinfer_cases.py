"""FlashInferBackend and SDPABackend side by side on random paged batches (see paged_attention_cases.py).

Shared by tests/unit/test_flashinfer_backend.py (CPU, with the torch stand-in `fake_flashinfer`: it
checks our adapter only) and tests/gpu/test_flashinfer_attention_gpu.py (CUDA, the real flashinfer).
"""

from __future__ import annotations

import torch

from mstar.engines.attention.sdpa import SDPABackend
from mstar.engines.base import KVLayout
from tests.unit.paged_attention_cases import Shape, random_batch

GQA4 = Shape(hq=4, hkv=1, head_dim=64, page_size=4, dtype=torch.float16)
MHA = Shape(hq=2, hkv=2, head_dim=64, page_size=3, dtype=torch.float16)  # a page size that is not a power of 2
GQA3_BF16 = Shape(hq=6, hkv=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
PAGE1 = Shape(hq=4, hkv=2, head_dim=64, page_size=1, num_pages=200, max_pages_per_seq=80, dtype=torch.float16)

# name -> kwargs of run_case
CASES = {
    "decode_gqa4": dict(shape=GQA4, seq_lens=[1, 5, 37, 130], query_lens=[1] * 4),
    "decode_mha": dict(shape=MHA, seq_lens=[3, 4, 100], query_lens=[1] * 3),
    "prefill_only": dict(shape=GQA4, seq_lens=[9, 13, 6], query_lens=[9, 13, 6]),
    "mixed_causal": dict(shape=GQA4, seq_lens=[9, 1, 13, 6, 70], query_lens=[9, 1, 1, 3, 67]),
    "mixed_gqa3_bf16": dict(shape=GQA3_BF16, seq_lens=[40, 17, 200], query_lens=[40, 1, 33]),
    "page_size_1": dict(shape=PAGE1, seq_lens=[7, 1, 30], query_lens=[2, 1, 30]),
    "non_causal": dict(shape=MHA, seq_lens=[7, 12, 30], query_lens=[7, 5, 20], causal=False),
    "sliding_window": dict(shape=GQA4, seq_lens=[11, 10, 40], query_lens=[4, 1, 30], window=7),
    "decode_window": dict(shape=MHA, seq_lens=[3, 150, 9], query_lens=[1, 1, 1], window=5),
    "decode_padded": dict(shape=GQA4, seq_lens=[17, 3, 66], query_lens=[1, 1, 1], pad_to=6,
                          warmup=([40, 50, 60, 70, 1, 2], [1] * 6)),
    "decode_padded_full": dict(shape=GQA3_BF16, seq_lens=[9, 100], query_lens=[1, 1], pad_to=2),
}


def make_pair(shape: Shape, device: str, seed: int = 0, **backend_kwargs):
    """(sdpa, flashinfer) backends whose pools hold the same random values (the FlashInfer pool has one
    more page, its scratch page)."""
    from mstar.engines.attention.flashinfer_backend import FlashInferBackend

    layout = KVLayout(shape.num_layers, shape.hkv, shape.head_dim, shape.dtype)
    sdpa = SDPABackend(layout, shape.num_pages, shape.page_size, device)
    backend_kwargs.setdefault("max_num_seqs", 16)
    fib = FlashInferBackend(layout, shape.num_pages, shape.page_size, device,
                            max_pages_per_seq=shape.max_pages_per_seq, **backend_kwargs)
    g = torch.Generator(device=device).manual_seed(seed)
    for cache in ("k_cache", "v_cache"):
        values = torch.randn(getattr(sdpa, cache).shape, generator=g, device=device).to(shape.dtype)
        getattr(sdpa, cache).copy_(values)
        getattr(fib, cache)[:, : shape.num_pages].copy_(values)
    return sdpa, fib


def compare(sdpa, fib, meta, q, k, v, pad_to: int | None = None, layer: int = 1) -> dict:
    """Run both backends on one batch: max abs errors of the outputs and of the pool pages."""
    sdpa.prepare(meta)
    ref = sdpa.forward(layer, q, k, v)
    extra = (pad_to or q.shape[0]) - q.shape[0]
    g = torch.Generator(device="cpu").manual_seed(99)
    pad = [torch.randn(extra, *x.shape[1:], generator=g).to(x) for x in (q, k, v)]
    fib.prepare(meta, pad_to=pad_to)
    out = fib.forward(layer, *(torch.cat([x, p]) for x, p in zip((q, k, v), pad)))
    n, pages = q.shape[0], sdpa.k_cache.shape[1]
    return {
        "out": (out[:n].float() - ref.float()).abs().max().item(),
        "ref_scale": ref.float().abs().max().item(),
        "rows": out.shape[0],
        "pad_finite": bool(torch.isfinite(out[n:]).all()),
        "k_cache": (fib.k_cache[:, :pages].float() - sdpa.k_cache.float()).abs().max().item(),
        "v_cache": (fib.v_cache[:, :pages].float() - sdpa.v_cache.float()).abs().max().item(),
    }


def run_case(shape: Shape, seq_lens, query_lens, device: str = "cpu", causal: bool = True,
             window: int | None = None, pad_to: int | None = None, warmup: tuple | None = None,
             **backend_kwargs) -> dict:
    """One comparison; `warmup` = (seq_lens, query_lens) of a batch run first, padded to `pad_to` too."""
    sdpa, fib = make_pair(shape, device, **backend_kwargs)
    if warmup is not None:
        compare(sdpa, fib, *random_batch(shape, *warmup, device, seed=7), pad_to=pad_to)
    return compare(sdpa, fib, *random_batch(shape, seq_lens, query_lens, device, causal=causal, window=window),
                   pad_to=pad_to)


def tolerance(dtype: torch.dtype, ref_scale: float) -> float:
    """Allowed max abs difference from SDPA: both round to `dtype` and sum in different orders."""
    atol, rtol = {torch.bfloat16: (2e-3, 2e-2), torch.float16: (5e-4, 5e-3)}[dtype]
    return atol + rtol * ref_scale
