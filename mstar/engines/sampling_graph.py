"""Sampling replayed from CUDA graphs: one graph launch per step instead of ~60 kernel launches.

Eager `sampling.sample` launches a few dozen small kernels per step, and on a slow host their launch
time (about 1 ms) exceeds a decode step's GPU time at small batches. `SamplerGraphs` captures
`sampling.sample_static` (the same draw with every stage on, no branch on the rows) at the decode
graphs' batch sizes, the first time a step has rows it serves (the engine's warm-up does that, before
the worker reports ready). A step then costs the host building the rows' parameter table, updating
the seen-token masks, three copies into the graph's static inputs and one replay. Rows it does not
serve (`sampling.graphable`: seeded, logprobs, presence/frequency penalties, min_tokens bans, top_k
over the prefilter) and batches over the largest size fall back to `sample`.

The noise comes from the default CUDA generator, which graphs advance on every replay, so draws
differ from eager ones for the same global seed but follow the same distribution; seeded requests
never take this path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from mstar.engines.cuda_graphs import BatchGraphs
from mstar.engines.sampling import SamplingRow, graphable, sample_static
from mstar.engines.sampling_filters import COLUMNS, RowTable, seen_masks

logger = logging.getLogger(__name__)


class SamplerGraphs:
    """`sample_static` captured at `sizes` on a CUDA `device`, for logits of one vocabulary size."""

    def __init__(self, sizes: Sequence[int], device: torch.device) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" must compare equal
            device = torch.device("cuda", torch.cuda.current_device())
        self.sizes, self.device = sorted(set(sizes)), device
        self._graphs: BatchGraphs | None = None
        self._vocab = 0
        self._unseen: torch.Tensor | None = None  # all-False masks for batches without repetition penalty
        # the last parameter table (pinned) and the rows' params it was built from: steady decoding
        # repeats the same rows step after step, and building the table costs the host per row
        self._table: torch.Tensor | None = None
        self._table_params: list = []
        self._table_repetition = False
        self.replays = 0

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor | None:
        """Sampled ids [N] (a device view, valid until the next call), or None when the batch is not
        served here (the caller then runs `sample`)."""
        n, vocab = logits.shape
        if n > self.sizes[-1] or logits.device != self.device or not all(graphable(r) for r in rows):
            return None
        if self._graphs is None or vocab != self._vocab:
            self._capture(vocab)
        assert self._graphs is not None and self._unseen is not None
        params = [r.params for r in rows]
        if self._table is None or params != self._table_params:
            # pinned: copied into the graph's input without a sync. The table depends on params (frozen)
            # and the vocabulary alone, and is only read, so a later step may reuse it while in flight.
            self._table = RowTable.columns(rows, vocab).pin_memory()
            self._table_repetition = any(p.repetition_penalty != 1.0 for p in params)
        self._table_params = params  # equal but other objects: the next step compares by identity alone
        table = self._table
        if self._table_repetition:
            seen = seen_masks(rows, vocab, self.device)
        else:
            seen = self._unseen[:n]
        self.replays += 1
        return self._graphs(logits.float(), table, seen)[0]

    def _capture(self, vocab: int) -> None:
        self._vocab = vocab
        self._table = None  # built for another vocabulary
        self._unseen = torch.zeros(self.sizes[-1], vocab, dtype=torch.bool, device=self.device)
        example = [((vocab,), torch.float32), ((COLUMNS,), torch.float32), ((vocab,), torch.bool)]
        self._graphs = BatchGraphs(sample_static, self.sizes, example, self.device)
        logger.info("sampling captured in CUDA graphs for batch sizes %s (vocabulary %d)", self.sizes, vocab)

