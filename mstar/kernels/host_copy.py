"""Copies between pinned host memory and device memory as one Triton kernel, for inside CUDA graphs.

A copy queued with `copy_(non_blocking=True)` runs on a copy engine; between kernels of one stream
each such copy costs a few microseconds of idle GPU (the compute stream waits for the copy engine and
back), whatever its size. A decode step's inputs and its sampled ids are a few hundred bytes, so a
kernel that reads or writes the pinned host memory itself (mapped into the device's address space,
as CUDA pins it) moves them in about one PCIe round trip, and, unlike a copy, can be captured in the
middle of a CUDA graph next to the kernels around it (`engines/autoregressive/step_graph.py`).

`copy_words(pairs)` copies each (source, destination) pair of one or two; every tensor is contiguous,
4-byte aligned and a whole number of 4-byte words long, and each pair's two tensors are equally long
in bytes. Either side may be pinned host memory or device memory (under TRITON_INTERPRET=1, plain
CPU tensors: the CPU tests run it that way). Launched without PDL: it keeps full stream order, so
every kernel after it sees what it wrote (`kernels/pdl.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # words per program


@triton.jit
def _copy_words_kernel(src0, dst0, n0, src1, dst1, n1, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if tl.program_id(1) == 0:
        mask = offsets < n0
        tl.store(dst0 + offsets, tl.load(src0 + offsets, mask=mask), mask=mask)
    else:
        mask = offsets < n1
        tl.store(dst1 + offsets, tl.load(src1 + offsets, mask=mask), mask=mask)


def _words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as int32 words (a view), or ValueError when they are not whole aligned words."""
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"copy_words needs 1-D contiguous tensors, got shape {tuple(t.shape)}")
    nbytes = t.numel() * t.element_size()
    if nbytes % 4 or t.data_ptr() % 4:
        raise ValueError(f"copy_words needs whole 4-byte words at a 4-byte aligned address ({nbytes} bytes)")
    return t.view(torch.uint8).view(torch.int32) if t.dtype != torch.int32 else t


def copy_words(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each (source, destination) of `pairs` (one or two) in one launch (module docstring)."""
    if not 1 <= len(pairs) <= 2:
        raise ValueError(f"copy_words takes one or two (source, destination) pairs, got {len(pairs)}")
    words = []
    for src, dst in pairs:
        s, d = _words(src), _words(dst)
        if s.numel() != d.numel():
            raise ValueError(f"copy_words: source of {s.numel() * 4} bytes, destination of {d.numel() * 4}")
        words.append((s, d))
    (s0, d0), (s1, d1) = words[0], words[-1]
    n1 = d1.numel() if len(words) == 2 else 0
    most = max(d0.numel(), n1)
    if most == 0:
        return
    grid = (triton.cdiv(most, BLOCK), len(words))
    _copy_words_kernel[grid](s0, d0, d0.numel(), s1, d1, n1, BLOCK=BLOCK, num_warps=4)
