"""Checks of kernels/small_vocab_sampling against the code predictor's PyTorch sampler; run with
TRITON_INTERPRET=1 (by test_small_vocab_sampling.py, in a fresh process)."""

from __future__ import annotations

import torch

from mstar.kernels import small_vocab_sampling
from mstar.layers.fused import FUSED
from mstar.models.qwen3_omni.code_predictor_sampling import MAX_VOCAB, SamplingTensors, sample_step


def check(vocab: int) -> None:
    rows = [(0.0, vocab, 2.0), (1.0, 1, 2.0), (1.0, vocab, 0.8), (0.7, 50, 0.8), (1.3, vocab, 2.0), (0.9, 3, 0.5)]
    b, steps = len(rows), 3
    table = torch.tensor(rows, dtype=torch.float64)
    st = SamplingTensors(table[:, 0].float(), table[:, 1].long(), table[:, 2].float(),
                         torch.empty(b, steps, vocab).exponential_())
    for step in range(steps):
        logits = 3 * torch.randn(b, vocab)
        got = sample_step(logits, st, step)  # the kernel (the interpreter serves CPU tensors)
        FUSED.enabled = False
        try:
            want = sample_step(logits, st, step)
        finally:
            FUSED.enabled = True
        assert torch.equal(got, want), (vocab, step, got, want)  # same noise, same draw
        assert got[0] == logits[0].argmax() and got[1] == logits[1].argmax()  # greedy and top_k 1


if __name__ == "__main__":
    assert FUSED.ops_for(torch.zeros(1)) is not None and MAX_VOCAB == small_vocab_sampling.MAX_VOCAB
    torch.manual_seed(0)
    for v in (64, 100, 256):  # (the interpreter sorts slowly: 2048, the code predictor's, takes minutes)
        check(v)
    try:
        small_vocab_sampling.sample_rows(torch.zeros(2, 5000), torch.ones(2), torch.ones(2).long(), torch.ones(2),
                                         torch.ones(2, 5000))
    except ValueError:
        pass
    else:
        raise AssertionError("a vocabulary over MAX_VOCAB was accepted")
    print("small vocab sampling ok")
