"""Structured outputs' token masks sent to the device and applied there, inside the sampler's CUDA graphs.

The autoregressive engine fills, for each step, the packed int32 bitmask row of every constrained row
(`GrammarMatcher.fill_bitmask`) into pinned host memory while the device runs that step's forward; one
non-blocking copy sends them, with a flag per row (1: constrained), into one device buffer that the
sampler graphs and step graphs read as a static input. Applying them is one launch (`kernels/token_mask.py`
on CUDA, the PyTorch form elsewhere or if the kernel cannot build) that sets each forbidden token's logit
to -inf in place and touches nothing in an unflagged row, so it is captured in the graphs unconditionally:
a batch without grammars pays one tiny launch, and the device flags are zeroed once when the last
constrained row leaves. No bool [rows, V] mask is built on the host and nothing is unpacked there.

The host rewrites its buffer only after the copy out of it has run (an event); the engine reads every
step's tokens before it stages the next step's masks anyway, since they depend on those tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.engines.grammar import GrammarMatcher
from mstar.engines.sampling_filters import triton_available
from mstar.kernels.guard import KernelGuard

_KERNEL = KernelGuard("token mask")


class TokenMasks:
    """The token masks of up to `rows` batch rows for logits of `width` columns whose column 0 is token id
    `offset`, on `device` (module docstring)."""

    def __init__(self, rows: int, width: int, device: torch.device | str, offset: int = 0) -> None:
        self.rows, self.offset = rows, offset
        self.words = -(-(offset + width) // 32)  # a row's bitmask covers the ids 0 .. offset + width - 1
        device = torch.device(device)
        cuda = device.type == "cuda"
        size = rows * (1 + self.words)  # flags [rows], then the bitmask [rows, words]: one span per copy
        with torch.inference_mode(False):  # graphs read them; the host writes them between replays
            self._host = torch.zeros(size, dtype=torch.int32, pin_memory=cuda)
            self._device = torch.zeros(size, dtype=torch.int32, device=device)
        self.flags = self._device[:rows]
        self.bitmask = self._device[rows:].view(rows, self.words)
        self._host_flags = self._host[:rows].numpy()
        self._host_bitmask = self._host[rows:].view(rows, self.words)
        self._copied = torch.cuda.Event() if cuda else None
        self._armed = False  # whether some device flag may be set
        self.staged = 0  # steps whose masks were sent

    def stage(self, matchers: Sequence[GrammarMatcher | None]) -> bool:
        """Fill the masks of batch rows 0 .. len(matchers) - 1 (row i constrained by matchers[i] unless it is
        None) and queue their copy to the device on the current stream; whether any row is constrained. With
        none, the device flags are cleared (once), so the graphs' launch masks nothing."""
        constrained = [i for i, m in enumerate(matchers) if m is not None]
        if not constrained:
            if self._armed:
                self.flags.zero_()
                self._armed = False
            return False
        assert len(matchers) <= self.rows, f"{len(matchers)} rows for token masks of {self.rows}"
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out of the host buffer has run
        n = constrained[-1] + 1
        self._host_flags[:] = 0
        self._host_flags[constrained] = 1
        bitmask = self._host_bitmask
        bitmask[:n].zero_()  # a matcher may write only its own vocabulary's words, or OR its bits in
        for i in constrained:
            matchers[i].fill_bitmask(bitmask, i)
        span = self.rows + n * self.words
        self._device[:span].copy_(self._host[:span], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self._armed = True
        self.staged += 1
        return True

    def apply_(self, logits: torch.Tensor) -> None:
        """Set to -inf, in place, the tokens the staged masks forbid in each flagged row of `logits` [N, V]
        (rows of the batch staged last; V the width given); capturable in a CUDA graph."""
        n = logits.shape[0]
        bitmask, flags = self.bitmask[:n], self.flags[:n]
        if logits.is_cuda and triton_available():
            _KERNEL.run(lambda: _mask_triton(logits, bitmask, flags, self.offset),
                        lambda: mask_logits_torch_(logits, bitmask, flags, self.offset))
        else:
            mask_logits_torch_(logits, bitmask, flags, self.offset)


def _mask_triton(logits: torch.Tensor, bitmask: torch.Tensor, flags: torch.Tensor, offset: int) -> None:
    from mstar.kernels.token_mask import mask_logits_

    mask_logits_(logits, bitmask, flags, offset)


def mask_logits_torch_(logits: torch.Tensor, bitmask: torch.Tensor, flags: torch.Tensor, offset: int = 0) -> None:
    """`kernels/token_mask.mask_logits_` in PyTorch: in each row i of `logits` [N, V] (columns: ids offset ..)
    with flags[i] != 0, the tokens whose bit is clear in bitmask[i] (or lie past its words) set to -inf."""
    n, vocab = logits.shape
    words = bitmask.shape[1]
    ids = torch.arange(offset, offset + vocab, device=logits.device)
    word = ids // 32
    bits = bitmask[:n].index_select(1, word.clamp(max=words - 1))
    allowed = ((bits >> (ids % 32).to(torch.int32)) & 1).bool() & (word < words)
    logits.masked_fill_(~allowed & (flags[:n, None] != 0), float("-inf"))
