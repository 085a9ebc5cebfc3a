"""The batched parts of `sampling.sample`: per-row parameters, seen-token masks, filters and the race.

Top-k / top-p / min-p without a full-vocabulary sort: the `PREFILTER_K` best logits of each row
are taken with `topk`, and the top-p nucleus is computed on them against the full distribution's
normaliser. A row is *covered* when every token outside the prefilter is provably dropped (it has
a top_k, or the prefilter's mass already reaches top_p, or min_p cuts inside it); only uncovered
rows need the whole vocabulary. They get it without a host sync: on CUDA a Triton kernel
(mstar/kernels/nucleus.py) that exits at once for covered rows and otherwise finds the exact nucleus
threshold by bisection; on CPU (where reading a flag is free) the sort-based reference.

The draw is the exponential race over the kept tokens: argmax(p / E) with E ~ Exp(1) per token id,
so which path computed a row never changes the token it gets for the same noise.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from mstar.engines.cuda_graphs import to_device_async
from mstar.kernels.guard import KernelGuard

if TYPE_CHECKING:
    from mstar.engines.sampling import SamplingRow

PREFILTER_K = 1024  # logits per row the top-p nucleus is first looked for in
COLUMNS = 8  # per-row parameters in a RowTable
TOP_K_COLUMN, TOP_P_COLUMN, MIN_P_COLUMN = 3, 4, 5  # where `RowTable.columns` puts them


class RowTable:
    """Per-row sampling parameters as [N, 1] device tensors, copied in one non-blocking transfer.

    Host-side flags (`any_greedy`, `any_repetition`, ...) let `sample` skip whole stages; the table
    of `RowTable.general` turns every stage on, for a computation that must not branch on the rows
    (a captured CUDA graph, `sampling.sample_static`).
    """

    def __init__(self, rows: Sequence[SamplingRow], vocab: int, device: torch.device) -> None:
        self._split(to_device_async(self.columns(rows, vocab), device), vocab)
        self.any_greedy = any(r.params.temperature == 0 for r in rows)
        self.all_greedy = all(r.params.temperature == 0 for r in rows)
        self.any_repetition = any(r.params.repetition_penalty != 1.0 for r in rows)
        self.any_min_p = any(r.params.min_p > 0 for r in rows)
        self.any_top_k = any(0 < r.params.top_k < vocab for r in rows)
        self.max_top_k = max((min(r.params.top_k, vocab) for r in rows), default=0)
        self.filtered = [0 < r.params.top_k or r.params.top_p < 1.0 for r in rows]

    @staticmethod
    def columns(rows: Sequence[SamplingRow], vocab: int) -> torch.Tensor:
        """The host float32 table [N, COLUMNS]: 1/temperature, penalty, 1/penalty, top_k (vocab: off),
        top_p (2: off), min_p, greedy (0/1), filtered by top-k or top-p (0/1)."""
        cols = []
        for r in rows:
            p = r.params
            temp = p.temperature if p.temperature > 0 else 1.0
            top_k = min(p.top_k, vocab) if p.top_k > 0 else vocab
            top_p = p.top_p if p.top_p < 1.0 else 2.0  # 2: no prefix mass ever reaches it
            cols.append((1.0 / temp, p.repetition_penalty, 1.0 / p.repetition_penalty, float(top_k), top_p,
                         p.min_p, float(p.temperature == 0), float(0 < p.top_k or p.top_p < 1.0)))
        return torch.tensor(cols, dtype=torch.float32).reshape(len(cols), COLUMNS)

    @classmethod
    def general(cls, table: torch.Tensor, vocab: int, filtered: bool = False) -> RowTable:
        """A table over device columns `table` [N, COLUMNS] with every stage on and no host flag read
        from the rows: top-k no wider than PREFILTER_K, any row may be greedy, filtered or penalised.
        `filtered`: every row is known to sample under top-k or top-p (none greedy)."""
        self = cls.__new__(cls)
        self._split(table, vocab)
        self.any_repetition = self.any_min_p = self.any_top_k = True
        self.any_greedy = not filtered
        self.all_greedy = False
        self.max_top_k = PREFILTER_K
        self.filtered = [True] * table.shape[0] if filtered else None  # else per row on the device only
        return self

    def _split(self, table: torch.Tensor, vocab: int) -> None:
        self.table = table  # [N, COLUMNS] on the device, as the fused race kernel reads it
        self.inv_temp, self.penalty, self.inv_penalty, self.top_k, self.top_p, self.min_p = (
            table[:, i : i + 1] for i in range(6))
        self.greedy = table[:, 6] > 0
        self.filtered_rows = table[:, 7] > 0
        self.vocab = vocab


def seen_masks(rows: Sequence[SamplingRow], vocab: int, device: torch.device,
               offset: int = 0) -> torch.Tensor:
    """Bool [N, vocab]: the tokens of each row's prompt and output, token id t at column t - offset
    (logits of the ids [offset, offset + vocab); ids outside them are left out).

    Kept across steps in the rows' caches as views of one batch tensor: while the batch is the same
    rows in the same order (steady decoding), a step only marks the tokens added since the last one,
    all rows in one copy and one indexed write. A new batch stacks the rows' masks once.
    """
    caches = [r.cache if r.cache is not None else {} for r in rows]
    batch = caches[0].get("seen_batch")
    if not (batch is not None and batch.shape == (len(rows), vocab) and batch.device == device
            and _same_batch(caches, batch)):
        batch = _restack(rows, caches, vocab, device)
    flat = []  # row * vocab + column of every token added since the last step
    end = offset + vocab
    for i, (row, cache) in enumerate(zip(rows, caches)):
        tokens = row.token_ids
        n, upto = len(tokens), cache.get("seen_upto", 0)
        if upto > n:  # the sequence restarted: rebuild its mask from scratch
            batch[i] = False
            upto = 0
        if n - upto == 1:  # steady decoding: one new token (no slice, no generator)
            if offset <= (t := tokens[upto]) < end:
                flat.append(i * vocab + t - offset)
        elif n > upto:
            flat.extend(i * vocab + t - offset for t in tokens[upto:] if offset <= t < end)
        cache["seen_upto"] = n
    if flat:
        # index_fill_ takes the value as a kernel argument; `batch[rows, cols] = True` would copy a
        # host scalar to the device, a synchronous copy that waits for the whole stream
        batch.view(-1).index_fill_(0, to_device_async(torch.tensor(flat, dtype=torch.long), device), True)
    return batch


def _same_batch(caches: list[dict], batch: torch.Tensor) -> bool:
    """Whether row i of `batch` is the mask of caches[i], for every i (a plain loop: runs every step)."""
    for i, cache in enumerate(caches):
        if cache.get("seen_batch") is not batch or cache.get("seen_row") != i:
            return False
    return True


def _restack(rows: Sequence[SamplingRow], caches: list[dict], vocab: int, device: torch.device) -> torch.Tensor:
    masks = []
    for row, cache in zip(rows, caches):
        seen = cache.get("seen")
        if seen is None or seen.shape != (vocab,) or seen.device != device or cache.get("seen_upto", 0) > len(row.token_ids):
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            cache["seen_upto"] = 0
        masks.append(seen)
    batch = torch.stack(masks)
    for i, cache in enumerate(caches):
        cache["seen_batch"], cache["seen_row"], cache["seen"] = batch, i, batch[i]
    return batch


def pick(x: torch.Tensor, rows: Sequence[SamplingRow] | None, table: RowTable, noise: torch.Tensor) -> torch.Tensor:
    """Sampled ids [N] of processed logits `x` [N, V] under each row's top-k / top-p / min-p
    (`rows` None: a `RowTable.general` table, every path computed and chosen per row on the device)."""
    if table.filtered is not None and not any(table.filtered):
        return race_full(x, table, noise)
    ids, covered, lse, vals = _race_prefiltered(x, table, noise)
    if table.filtered is None or not all(table.filtered):  # rows with neither top-k nor top-p: whole vocabulary
        mask = table.filtered_rows
        ids = torch.where(mask, ids, race_full(x, table, noise))
        covered = covered | ~mask
    pmin = table.min_p[:, 0] * (vals[:, 0] - lse[:, 0]).exp()  # min_p times the top probability
    return _fallback(x, ids, ~covered, lse[:, 0], table.top_p[:, 0], pmin, noise)


def race_full(x: torch.Tensor, table: RowTable, noise: torch.Tensor) -> torch.Tensor:
    """Draw from the whole vocabulary (min-p applied)."""
    probs = x.softmax(dim=-1)
    if table.any_min_p:
        probs = probs.masked_fill(probs < table.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return (probs / noise).argmax(dim=-1)


def _race_prefiltered(x: torch.Tensor, table: RowTable,
                      noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, covered, full log-normaliser [N, 1], top logits [N, K]) from the top-K prefilter."""
    k = min(x.shape[1], max(PREFILTER_K, table.max_top_k))
    vals, idx = x.topk(k, dim=-1)
    top = vals[:, :1]
    # as softmax computes it (exp(x - max) / sum): nucleus edges fall where the sort-based path puts them
    total = (x - top).exp().sum(dim=-1, keepdim=True)
    if x.is_cuda and table.table.is_cuda and k <= 4096 and _FUSED_RACE.usable and triton_available():
        # the rest in one kernel (None: it failed once, the PyTorch form below serves from now on)
        fused = _FUSED_RACE.run(lambda: _prefilter_race(vals, idx, total[:, 0], table, noise), lambda: None)
        if fused is not None:
            ids, covered, lse = fused
            return ids, covered, lse[:, None], vals
    lse = top + total.log()
    e = (vals - top).exp()
    if table.any_top_k:  # top-p then applies to the distribution renormalised over the top k
        ranks = torch.arange(k, device=x.device)[None, :]
        e = e.masked_fill(ranks >= table.top_k, 0.0)
        total = torch.where(table.top_k < table.vocab, e.sum(dim=-1, keepdim=True), total)
    p = e / total
    cum = p.cumsum(dim=-1)
    keep = cum - p < table.top_p  # the mass strictly before a token is below top_p: the first always stays
    covered = (table.top_k < table.vocab) | (cum[:, -1:] >= table.top_p)
    if table.any_min_p:
        keep &= p >= table.min_p * p[:, :1]
        covered |= p[:, -1:] < table.min_p * p[:, :1]
    score = torch.where(keep, p / noise.gather(1, idx), -1.0)
    ids = idx.gather(1, score.argmax(dim=-1, keepdim=True))[:, 0]
    return ids, covered[:, 0], lse, vals


@functools.cache
def triton_available() -> bool:
    """Whether triton is installed (the CUDA paths use its sampling kernels only then)."""
    return importlib.util.find_spec("triton") is not None


_FUSED_RACE = KernelGuard("fused prefilter race")


def _prefilter_race(vals: torch.Tensor, idx: torch.Tensor, total: torch.Tensor, table: RowTable,
                    noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from mstar.kernels.nucleus import prefilter_race_

    return prefilter_race_(vals, idx, total, table.table, noise, table.vocab, (TOP_K_COLUMN, TOP_P_COLUMN, MIN_P_COLUMN))


def _fallback(x: torch.Tensor, ids: torch.Tensor, need: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor,
              pmin: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`ids` with the rows in `need` redrawn over the whole vocabulary (exact nucleus), sync-free on CUDA."""
    if x.device.type == "cuda":
        if triton_available():
            from mstar.kernels.nucleus import nucleus_race_

            return nucleus_race_(x, noise, ids, need, lse, top_p, pmin)
        return torch.where(need, race_sorted(x, top_p, pmin, lse, noise), ids)
    if not bool(need.any()):  # on the host a flag costs nothing to read
        return ids
    rows = need.nonzero()[:, 0]
    ids = ids.clone()
    ids[rows] = race_sorted(x[rows], top_p[rows], pmin[rows], lse[rows], noise[rows])
    return ids


def race_sorted(x: torch.Tensor, top_p: torch.Tensor, pmin: torch.Tensor, lse: torch.Tensor,
                noise: torch.Tensor) -> torch.Tensor:
    """The reference: sort the whole vocabulary, keep the top-p nucleus and p >= pmin, race. [N] ids."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    p = (sorted_x - lse[:, None]).exp()
    keep = (p.cumsum(dim=-1) - p < top_p[:, None]) & (p >= pmin[:, None])
    score = torch.where(keep, p / noise.gather(1, order), -1.0)
    return order.gather(1, score.argmax(dim=-1, keepdim=True))[:, 0]
