"""Checks of kernels/small_vocab_sampling against the code predictor's PyTorch sampler; run with
TRITON_INTERPRET=1 (by test_small_vocab_sampling.py, in a fresh process)."""

from __future__ import annotations

import sys

import torch

from mstar.layers.fused import FUSED, fused_kernels
from mstar.models.qwen3_omni import small_vocab_sampling
from mstar.models.qwen3_omni.code_predictor_sampling import (
    MAX_VOCAB,
    SamplingTensors,
    sample_and_embed,
    sample_step,
)


def check(vocab: int) -> None:
    rows = [(0.0, vocab, 2.0), (1.0, 1, 2.0), (1.0, vocab, 0.8), (0.7, 50, 0.8), (1.3, vocab, 2.0), (0.9, 3, 0.5)]
    b, steps = len(rows), 3
    table = torch.tensor(rows, dtype=torch.float64)
    st = SamplingTensors(table[:, 0].float(), table[:, 1].long(), table[:, 2].float(),
                         torch.empty(b, steps, vocab).exponential_())
    for step in range(steps):
        logits = 3 * torch.randn(b, vocab)
        got = sample_step(logits, st, step)  # the kernel (the interpreter serves CPU tensors)
        with fused_kernels(False):
            want = sample_step(logits, st, step)
        assert torch.equal(got, want), (vocab, step, got, want)  # same noise, same draw
        assert got[0] == logits[0].argmax() and got[1] == logits[1].argmax()  # greedy and top_k 1


def check_embed(vocab: int, hidden: int, dtype: torch.dtype) -> None:
    """sample_and_embed through the kernel (codes, embedding rows, running sums) equals its PyTorch form, for
    a sampled batch and an all-greedy one (noise None), with logits in the head's dtype."""
    rows = [(0.0, vocab, 2.0), (1.0, vocab, 0.8), (0.7, 5, 0.9), (1.2, vocab, 2.0)]
    b, steps = len(rows), 2
    table = torch.tensor(rows, dtype=torch.float64)
    sampled = SamplingTensors(table[:, 0].float(), table[:, 1].long(), table[:, 2].float(),
                              torch.empty(b, steps, vocab).exponential_())
    greedy = SamplingTensors(torch.zeros(b), torch.full((b,), vocab), torch.full((b,), 2.0), None)
    codebook = torch.randn(vocab, hidden).to(dtype)
    for st in (sampled, greedy):
        embed_sum = torch.randn(b, hidden).to(dtype)
        for step in range(steps):
            logits = (3 * torch.randn(b, vocab)).to(dtype)
            got = sample_and_embed(logits, st, step, codebook, embed_sum)
            with fused_kernels(False):
                want = sample_and_embed(logits, st, step, codebook, embed_sum)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and torch.equal(g, w), (vocab, step, g, w)
            embed_sum = got[2]


if __name__ == "__main__":
    assert FUSED.ops_for(torch.zeros(1)) is not None and MAX_VOCAB == small_vocab_sampling.MAX_VOCAB
    torch.manual_seed(0)
    if "--quick" in sys.argv:  # one representative of each kernel (the default test run)
        check(64)
        check_embed(64, 40, torch.float32)
        print("small vocab sampling ok")
        sys.exit(0)
    for v in (64, 100, 256):  # (the interpreter sorts slowly: 2048, the code predictor's, takes minutes)
        check(v)
    check_embed(64, 40, torch.float32)
    check_embed(100, 16, torch.float16)  # (the interpreter rounds float32 -> bfloat16 toward zero; a GPU to nearest)
    try:
        small_vocab_sampling.sample_rows(torch.zeros(2, 5000), torch.ones(2), torch.ones(2).long(), torch.ones(2),
                                         torch.ones(2, 5000))
    except ValueError:
        pass
    else:
        raise AssertionError("a vocabulary over MAX_VOCAB was accepted")
    print("small vocab sampling ok")
