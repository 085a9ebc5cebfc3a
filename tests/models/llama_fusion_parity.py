"""Greedy decoding of a tiny Llama through TritonBackend with the decode fusions on and off; run with
TRITON_INTERPRET=1 by test_llama_decode_fusions.py (a fresh process: triton reads that variable when
kernels are decorated). Prints one JSON line: per dtype, the tokens of both runs, the largest logit
difference of their last step and how many fused norm GEMVs ran."""

from __future__ import annotations

import json
import os
import sys

import torch

from mstar.engines.attention.base import AttentionMetadata
from mstar.engines.attention.triton_backend import TritonBackend
from mstar.kernels import skinny_gemm
from mstar.kernels.decode_attention import decode_num_splits
from mstar.layers.fused import FUSED
from mstar.layers.linear import SKINNY
from mstar.models.common.loading import fill_dummy_weights
from mstar.models.llama.model import build_model
from mstar.models.llama.tiny import tiny_config

PAGE, PAGES_PER_SEQ = 4, 48  # 192 tokens of room: the decode launches split KV (see greedy)
# The second is long enough for its decode keys to span two KV splits (64 keys each), so that merging runs.
PROMPTS = ([5, 9, 33, 7, 101, 64], [(37 * i + 11) % 256 for i in range(70)])


def _meta(query_lens: list[int], seq_lens: list[int], seqs: list[int]) -> AttentionMetadata:
    slots = [(s * PAGES_PER_SEQ) * PAGE + p for s, q, n in zip(seqs, query_lens, seq_lens) for p in range(n - q, n)]
    tables = torch.tensor([[s * PAGES_PER_SEQ + i for i in range(PAGES_PER_SEQ)] for s in seqs], dtype=torch.int32)
    return AttentionMetadata(query_lens, seq_lens, torch.tensor(slots), tables)


def _backend(model) -> TritonBackend:
    attn = TritonBackend(model.kv_layout, num_pages=2 * PAGES_PER_SEQ, page_size=PAGE, device="cpu",
                         max_num_seqs=4, max_pages_per_seq=PAGES_PER_SEQ)
    attn.num_sms = 8  # 3 rows x 2 KV heads: 3 KV splits per (sequence, KV head)
    assert decode_num_splits(3, 2, attn.num_sms, PAGES_PER_SEQ * PAGE) == 3
    return attn


@torch.inference_mode()
def prefill(model) -> tuple[TritonBackend, list[int]]:
    """Each prompt alone through a fresh backend (no fusion applies: more than 4 rows, not decode)."""
    attn = _backend(model)
    first = []
    for s, prompt in enumerate(PROMPTS):
        attn.prepare(_meta([len(prompt)], [len(prompt)], [s]))
        hidden = model.forward(torch.tensor(prompt), torch.arange(len(prompt)), attn)
        first.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return attn, first


@torch.inference_mode()
def decode(model, prefilled: TritonBackend, first: list[int], fused: bool, steps: int,
           pad_to: int) -> tuple[list[list[int]], torch.Tensor, int]:
    """Decode both prompts together, padded to `pad_to` rows, from a copy of the prefilled caches;
    returns the tokens, the last step's logits and how many layers attended through forward_rotary."""
    attn = _backend(model)
    attn.k_cache.copy_(prefilled.k_cache)
    attn.v_cache.copy_(prefilled.v_cache)
    attn.fuse_rotary = attn.fuse_reduce = FUSED.norm_linear = fused
    rotary_calls = []
    inner = attn.forward_rotary
    attn.forward_rotary = lambda *a: rotary_calls.append(1) or inner(*a)
    tokens, logits = [[t] for t in first], None
    for _ in range(steps):
        lens = [len(p) + len(t) for p, t in zip(PROMPTS, tokens)]
        attn.prepare(_meta([1, 1], lens, [0, 1]), pad_to=pad_to)
        ids = torch.tensor([t[-1] for t in tokens] + [0] * (pad_to - 2))
        positions = torch.tensor([n - 1 for n in lens] + [0] * (pad_to - 2))
        logits = model.compute_logits(model.forward(ids, positions, attn)[:2])
        for t, row in zip(tokens, logits):
            t.append(int(row.argmax()))
    assert int(attn._lock.abs().sum()) == 0, "split counters not reset"
    return tokens, logits, len(rotary_calls)


def run(dtype: torch.dtype) -> dict:
    model = build_model(tiny_config("llama"), dtype, "cpu")
    fill_dummy_weights(model, seed=0, std=0.15)  # spread logits: greedy choices are not near-ties
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(dtype) * 0.2)
    calls = []
    original, heuristic = skinny_gemm.skinny_norm_linear, skinny_gemm._gemv_config
    skinny_gemm.skinny_norm_linear = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    # Wide GEMV tiles: the interpreter's cost is per program (the kernels' own checks cover small tiles).
    skinny_gemm._gemv_config = lambda bucket, n, k, sms: skinny_gemm.SkinnyConfig(bucket, 64, 64)
    SKINNY.force = True  # the skinny GEMV serves every projection in both runs (on CPU only when forced)
    try:
        prefilled, first = prefill(model)
        off_tokens, off_logits, off_rotary = decode(model, prefilled, first, False, steps=2, pad_to=3)
        fused_before = len(calls)
        on_tokens, on_logits, on_rotary = decode(model, prefilled, first, True, steps=2, pad_to=3)
    finally:
        skinny_gemm.skinny_norm_linear, skinny_gemm._gemv_config = original, heuristic
        SKINNY.force, FUSED.norm_linear = None, False
    return {"off": off_tokens, "on": on_tokens, "fused_norm_calls": [fused_before, len(calls)],
            "rotary_in_attention_calls": [off_rotary, on_rotary],
            "logit_err": (on_logits.float() - off_logits.float()).abs().max().item(),
            "logit_scale": off_logits.float().abs().max().item()}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
    from paged_attention_cases import _fix_interpreter_scalars

    _fix_interpreter_scalars()
    torch.manual_seed(0)
    print(json.dumps({str(dt): run(dt) for dt in (torch.float32, torch.bfloat16)}))
