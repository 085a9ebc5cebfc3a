"""Output heads that score, per row, only the ids its input token allows next (`LogitWindows`).

A model whose next token is known to lie in a window of ids picked by the token just fed (Orpheus: the
codes of the next SNAC frame place) needs only that window's head rows. `head_logits` gives float32
logits over the whole head's columns, -inf outside each row's window: on CUDA for a few rows in one
kernel that reads the window's rows alone (`mstar.kernels.window_head`), elsewhere by masking the whole
head's logits (`masked_window_logits`, the reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from mstar.layers.fused import FUSED
from mstar.layers.linear import linear_weight


@dataclass(frozen=True)
class LogitWindows:
    """Which head columns a row may score, keyed by the row's input token.

    `starts` int32 [vocabulary], on the head's device: the first column of the window of the token
    after id t; `width`: columns per window; `always`: columns every row scores too, outside every
    window (e.g. end of speech). Every window lies inside the head's columns."""

    starts: torch.Tensor
    width: int
    always: tuple[int, ...] = ()

    def check(self, columns: int, vocab: int) -> None:
        """Raise ValueError unless every window and `always` column fits `columns` head columns and
        `starts` has one entry per id of a `vocab`-id vocabulary."""
        if self.starts.shape != (vocab,) or self.starts.dtype != torch.int32:
            raise ValueError(f"LogitWindows.starts must be int32 [{vocab}], got {self.starts.dtype} "
                             f"{tuple(self.starts.shape)}")
        lo, hi = int(self.starts.min()), int(self.starts.max())
        if self.width < 1 or lo < 0 or hi + self.width > columns:
            raise ValueError(f"LogitWindows: windows [{lo}, {hi} + {self.width}) do not fit {columns} columns")
        if any(not 0 <= c < columns for c in self.always):
            raise ValueError(f"LogitWindows.always {self.always} outside the {columns} columns")

    def to(self, device: torch.device | str) -> LogitWindows:
        return LogitWindows(self.starts.to(device), self.width, self.always)

    @cached_property
    def always_tensor(self) -> torch.Tensor:
        """`always` as int32 on the device of `starts` (one [0] when empty), made at the first call: the
        warm-up before any graph capture, so replays keep reading it."""
        return torch.tensor(list(self.always) or [0], dtype=torch.int32, device=self.starts.device)


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
                windows: LogitWindows, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits [M, weight rows] of hidden [M, K] over `weight` [columns, K], each row scored on the
    window of its input token (`input_ids` [M], on hidden's device) and the `always` columns, -inf
    elsewhere. `out` (float32 [M, weight rows]): where the fused kernel writes them when it serves the
    rows; a hint, the returned tensor is the logits either way."""
    if FUSED.ops_for(hidden) is not None:
        from mstar.kernels import window_head

        if window_head.fits(hidden, weight):
            return window_head.window_logits(hidden, weight, input_ids, windows, out=out)
    return masked_window_logits(linear_weight(hidden, weight).float(), input_ids, windows)


def masked_window_logits(logits: torch.Tensor, input_ids: torch.Tensor, windows: LogitWindows) -> torch.Tensor:
    """`logits` [M, columns] (float32, the whole head's) with -inf in every column that is neither in
    row m's window nor in `always`, in place; returned. Graph-safe (no host sync, no host tensor)."""
    start = windows.starts[input_ids].to(torch.long)[:, None]
    cols = torch.arange(logits.shape[1], device=logits.device)
    keep = (cols >= start) & (cols < start + windows.width)
    for column in windows.always:
        keep[:, column] = True
    return logits.masked_fill_(~keep, float("-inf"))
