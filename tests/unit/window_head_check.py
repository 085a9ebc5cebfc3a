"""Checks of kernels/window_head against the masked whole-head reference; run with TRITON_INTERPRET=1 (by
test_logit_windows.py, in a fresh process)."""

from __future__ import annotations

import torch

from mstar.kernels import window_head
from mstar.layers.logit_windows import LogitWindows, head_logits, masked_window_logits


def check(rows: int, k: int, dtype: torch.dtype, block_n: int, block_k: int) -> None:
    columns, width = 61, 12
    gen = torch.Generator().manual_seed(rows * 100 + k)
    weight = torch.randn(columns, k, generator=gen).to(dtype)
    hidden = torch.randn(rows, k, generator=gen).to(dtype)
    vocab = 40
    starts = torch.randint(1, columns - width + 1, (vocab,), generator=gen, dtype=torch.int32)
    windows = LogitWindows(starts, width, always=(0, columns - 1))
    ids = torch.randint(0, vocab, (rows,), generator=gen)
    got = window_head.window_logits(hidden, weight, ids, windows, block_n=block_n, block_k=block_k)
    want = masked_window_logits(torch.nn.functional.linear(hidden.float(), weight.float()), ids, windows)
    assert got.dtype == torch.float32 and got.shape == (rows, columns)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), (got, want)
    finite = ~torch.isinf(want)
    assert finite.sum() == rows * (width + 2)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-2 if dtype != torch.float32 else 1e-4, rtol=1e-2)
    # the layer picks the kernel here (the interpreter serves CPU tensors) and gives the same logits
    assert torch.equal(head_logits(hidden, weight, ids, windows), window_head.window_logits(hidden, weight, ids, windows))
    # into the first rows of a larger buffer (a sampler's logits rows): every column written, nothing past them
    buffer = torch.full((rows + 2, columns), 7.0)
    into = window_head.window_logits(hidden, weight, ids, windows, block_n=block_n, block_k=block_k,
                                     out=buffer[:rows])
    assert into.data_ptr() == buffer.data_ptr() and torch.equal(into, got)
    assert torch.equal(buffer[rows:], torch.full((2, columns), 7.0))
    buffer[:rows] = 7.0  # and the layer hands `out` on to the kernel
    assert head_logits(hidden, weight, ids, windows, out=buffer[:rows]).data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:rows], head_logits(hidden, weight, ids, windows))
    try:
        window_head.window_logits(hidden, weight, ids, windows, out=buffer[:rows, :-1])
    except ValueError as exc:
        assert "out must be float32" in str(exc)
    else:
        raise AssertionError("a narrower out was taken")


if __name__ == "__main__":
    for rows, k, dtype, block_n, block_k in [(1, 64, torch.float32, 16, 32), (3, 80, torch.float32, 8, 32),
                                             (6, 64, torch.bfloat16, 16, 64), (2, 96, torch.bfloat16, 4, 32)]:
        check(rows, k, dtype, block_n, block_k)
    print("window head ok")
