"""Orpheus' LM as its engine runs it: the Llama decoder with a head that scores only the ids it speaks.

Orpheus speaks end of speech and audio tokens only: a contiguous span of the vocabulary (28,680 of
156,940 ids at full size, `OrpheusTokens.speakable_span`) with a few marker ids inside it that it never
says (`span_markers`). `SpanHeadLM` reads only the span's rows of the head and returns their logits
alone, [N, hi - lo]: the span is its logit window (`CausalLM.logit_offset` = lo), so the sampler too
works over those columns and the other ids are never sampled. With `windows` (`LogitWindows`: the
codes the next frame place can take, picked by the token just fed) each row is narrowed further, and
on CUDA the head reads just those rows (`kernels/window_head.py`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mstar.engines.base import CausalLMBase
from mstar.engines.extras import ForwardExtras
from mstar.layers.linear import linear_weight
from mstar.layers.logit_windows import LogitWindows, head_logits
from mstar.models.llama.model import LlamaForCausalLM


class SpanHeadLM(CausalLMBase, nn.Module):
    """`lm` whose `compute_logits` covers the ids [lo, hi) = `span` only, the ids [a, b) = `blocked`
    inside it at -inf, and, with `windows` (columns of the span; blocked ids must lie outside every
    window), -inf outside the window each row's input token picks (module doc)."""

    accepts_extras = True

    def __init__(self, lm: LlamaForCausalLM, span: tuple[int, int], blocked: tuple[int, int] | None = None,
                 windows: LogitWindows | None = None) -> None:
        super().__init__()
        vocab = lm.config.vocab_size
        lo, hi = span
        if not 0 <= lo < hi <= vocab:
            raise ValueError(f"span={span} is not a non-empty id range [lo, hi) inside the vocabulary [0, {vocab})")
        if blocked is not None and not lo <= blocked[0] < blocked[1] <= hi:
            raise ValueError(f"blocked={blocked} is not a non-empty id range [a, b) inside span={span}")
        if windows is not None:  # checked where they were made: a head built on the meta device has no values
            windows.check(hi - lo, vocab)
            if blocked is not None and _window_columns(windows, hi - lo)[blocked[0] - lo:blocked[1] - lo].any():
                raise ValueError(f"blocked={blocked} overlaps a window")
            windows = windows.to(lm.lm_head.weight.device)
        self.lm = lm
        self.kv_layout, self.hidden_size = lm.kv_layout, lm.hidden_size
        self.span = (int(lo), int(hi))
        self.logit_offset, self.logit_width = self.span[0], self.span[1] - self.span[0]
        self.blocked_ids = None if blocked is None else (int(blocked[0]), int(blocked[1]))
        self.logit_windows = windows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any,
                extras: ForwardExtras | None = None) -> torch.Tensor:
        return self.lm.forward(input_ids, positions, attn, extras)

    def compute_logits(self, hidden: torch.Tensor, input_ids: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, hi - lo] (class doc). `out` (float32 [N, hi - lo]): where the
        window head writes them when it serves the rows (`CausalLM`: a hint; check what is returned)."""
        lo, hi = self.span
        # A view taken now always reads the loaded weight; its rows are contiguous, so the skinny GEMV serves it.
        weight = self.lm.lm_head.weight[lo:hi]
        if self.logit_windows is not None:
            if input_ids is None:
                raise ValueError("compute_logits: this head scores per-row windows; pass the rows' input_ids")
            return head_logits(hidden, weight, input_ids, self.logit_windows, out=out)  # blocked ids lie outside
        logits = linear_weight(hidden, weight).float()
        if self.blocked_ids is not None:
            a, b = self.blocked_ids
            logits[:, a - lo:b - lo].fill_(-math.inf)  # a kernel argument: no host scalar copied
        return logits


def _window_columns(windows: LogitWindows, columns: int) -> torch.Tensor:
    """Bool [columns] (host): the columns some window or `always` covers."""
    covered = torch.zeros(columns + windows.width, dtype=torch.bool)
    for start in windows.starts.unique().tolist():
        covered[start:start + windows.width] = True
    covered[list(windows.always)] = True
    return covered[:columns]
