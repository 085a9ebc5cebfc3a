"""Sampling replayed from CUDA graphs: one graph launch per step instead of ~60 kernel launches.

Eager `sampling.sample` launches a few dozen small kernels per step, and on a slow host their launch
time exceeds a decode step's GPU time at small batches. `SamplerGraphs` captures
`sampling.sample_static` (the same draw with every stage on, no branch on the rows) at the decode
graphs' batch sizes, the first time a step has rows it serves (the engine's warm-up does that, before
the worker reports ready). Rows it does not serve (`sampling.graphable`: seeded, logprobs,
presence/frequency penalties, min_tokens bans, top_k over the prefilter) and batches over the
largest size fall back to `sample`. Rows under a grammar (structured outputs) are served when the graphs
were given the engine's `TokenMasks` (engines/token_masks.py): every captured draw first applies the
masks staged for its batch to the logits in place (nothing in a row without a grammar).

Two sets of graphs share their inputs: `general` (any row may be greedy or unfiltered) and
`filtered`, for batches whose every row samples under top-k or top-p (the usual serving case,
Orpheus's defaults among them). `filtered` leaves out the whole-vocabulary race of unfiltered rows
(a softmax, a divide and an argmax over the vocabulary) and the greedy rows' argmax, which at batch 1
are single-block reductions over the whole vocabulary and a visible share of a small model's step.

A steady step costs the host one copy of the logits into the graphs' input, one packed copy of
pinned host memory (the rows' parameter table, rebuilt only when the rows' params change, and each
row's newly seen token) and one replay. The seen-token masks of the repetition penalty live in one
device buffer across steps (`SeenRows`); the replay itself marks each row's new token.

Logits over a window of ids [offset, offset + V) (`CausalLM.logit_offset`) are captured at their
width V: the masks hold columns (token id - offset; ids outside the window are left out) and the
captured step adds the offset to the drawn columns, so the ids it returns are token ids (with no
extra launch; offset 0 captures no add).

The `general` graphs' noise comes from the default CUDA generator, which graphs advance on every
replay; the `filtered` graphs' from philox inside the sampling kernels, keyed by a seed taken from
PyTorch's default generator at capture plus a draw count the kernels advance on the device (no
generator in the graph, so no seed and offset refresh before each replay). Either way draws differ
from eager ones for the same global seed but follow the same distribution; seeded requests never
take this path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from mstar.engines.cuda_graphs import BatchGraphs, to_device_async
from mstar.engines.sampling import SamplingParams, SamplingRow, graphable, sample_static
from mstar.engines.sampling_filters import COLUMNS, RowTable
from mstar.engines.token_masks import TokenMasks

logger = logging.getLogger(__name__)


class SamplerGraphs:
    """`sample_static` captured at `sizes` on a CUDA `device`, for logits of one vocabulary size,
    whose column 0 is token id `offset`.

    Each call's inputs are staged in one of two pinned host sets, used in turn; a set is rewritten
    only once the copy out of it is done (an event; the engine reads every call's ids before the next
    call anyway).

    `logits` (optional, float32 [>= max(sizes), V], contiguous): the buffer the decode graphs write
    their logits into (`ModelRunner.logits_out`); the graphs read it as their input, so logits already
    there are not copied. `ids` (optional, int64 [>= max(sizes)]): the decode graphs' token-id input
    (`ModelRunner.decode_ids`); the graphs write the drawn ids there, every row of the bucket clamped
    into the logits' window (padding rows too, which the next forward embeds), so a lookahead forward
    fed with them needs no copy. Both are used only when their shape fits."""

    def __init__(self, sizes: Sequence[int], device: torch.device, offset: int = 0,
                 logits: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                 masks: TokenMasks | None = None) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" must compare equal
            device = torch.device("cuda", torch.cuda.current_device())
        self.sizes, self.device, self.offset = sorted(set(sizes)), device, offset
        self._graphs: dict[bool, BatchGraphs] = {}  # filtered (every row top-k/top-p, none greedy) -> graphs
        self._logits: list[torch.Tensor] = []  # [k] = the first k rows of the graphs' shared logits input
        self._vocab = 0
        self._seen: SeenRows | None = None
        self._inputs: _PackedInputs | None = None
        self.replays = 0
        self.logit_copies = 0  # calls whose logits were not already in the graphs' input
        self._given_logits, self._given_ids = logits, ids
        self.masks = masks  # applied first in every captured draw; without them constrained rows are not served
        self._ids: torch.Tensor | None = None  # the given ids, once captured with them
        self._rng: torch.Tensor | None = None  # the filtered graphs' seed and draw count (made at capture)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor | None:
        """Sampled token ids [N] (a device view, valid until the next call), or None when the batch is
        not served here (the caller then runs `sample`)."""
        if not self.serves(logits, rows):
            return None
        assert self._inputs is not None
        inputs = self._inputs
        host = inputs.next_host()
        filtered, bucket = self.stage(rows, host)
        inputs.send(host, bucket)
        self.replays += 1
        n = len(rows)
        static = self._logits[n]
        if logits.data_ptr() != static.data_ptr():  # else the decode graph wrote them here already
            static.copy_(logits)  # into the shared input, converted to float32 in the same kernel
            self.logit_copies += 1
        return self._graphs[filtered](static, inputs.table_rows[n], inputs.new_rows[n], bucket=bucket)[0]

    def serves(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> bool:
        """Whether a batch of these logits and rows is drawn here (capturing the graphs at the first one)."""
        n, vocab = logits.shape
        if n > self.sizes[-1] or logits.device != self.device or not all(graphable(r) for r in rows):
            return False
        if self.masks is None and any(r.params.structured_outputs is not None for r in rows):
            return False
        if not self._graphs or vocab != self._vocab:
            self.capture(vocab)
        return True

    def stage(self, rows: Sequence[SamplingRow], host: _HostInputs) -> tuple[bool, int]:
        """Write a call's inputs (the rows' table, each row's new token to mark) into `host`, padded to
        the bucket; (filtered: which graph set draws it, bucket). Copies nothing to the device."""
        assert self._seen is not None
        n = len(rows)
        params = [r.params for r in rows]
        if params != host.params:  # the table depends on params (frozen) and the vocabulary alone
            host.table_np[:n] = RowTable.columns(rows, self._vocab).numpy()
            host.table_np[n:] = 0  # padding rows: all zero, which every stage treats as covered
            host.repetition = any(p.repetition_penalty != 1.0 for p in params)
            host.filtered = all(p.temperature > 0 and (0 < p.top_k or p.top_p < 1.0) for p in params)
        host.params = params  # equal but maybe other objects: the next comparison is by identity alone
        bucket = self._graphs[host.filtered].bucket(n)
        assert bucket is not None
        if host.repetition:
            self._seen.mark(rows, host.new_np, bucket)
        else:  # no row reads its mask (penalty 1): masks and caches are left as they are
            host.new_np[:bucket] = self._seen.trash
        return host.filtered, bucket

    def staging(self) -> _HostInputs:
        """A pinned host set of the graphs' packed inputs for a caller that copies it in itself (`stage`
        into it, then copy `span(bucket, host)` to `span(bucket)`); rewritten only by its stagings."""
        assert self._inputs is not None, "capture first"
        return self._inputs.staging()

    def span(self, bucket: int, host: _HostInputs | None = None) -> torch.Tensor:
        """The packed input bytes a call of `bucket` rows reads: of the device buffer, or of `host`."""
        assert self._inputs is not None, "capture first"
        return self._inputs.span(bucket) if host is None else host.spans[bucket]

    def draw_step(self, filtered: bool) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """The function the `filtered` graphs capture: (logits, table, new) -> token ids, written into the
        decode graphs' id input when the sampler was given it (`writes_ids`)."""
        assert self._seen is not None, "capture first"
        return _marking(self._seen, filtered, self.offset, self._ids, self._rng if filtered else None, self.masks)

    @property
    def noise_state(self) -> torch.Tensor | None:
        """The filtered graphs' noise key as int64 [2] on the device: seed, draws so far (None before capture)."""
        return self._rng

    @property
    def writes_ids(self) -> bool:
        """Whether the graphs draw straight into the `ids` given (the decode graphs' id input)."""
        return self._ids is not None

    def input_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first `n` rows (views made once) of each of the graphs' inputs: logits (the decode graphs'
        `logits_out` when given), table, new."""
        assert self._inputs is not None, "capture first"
        return self._logits[n], self._inputs.table_rows[n], self._inputs.new_rows[n]

    def capture(self, vocab: int) -> None:
        """Capture both graph sets for logits of `vocab` columns (done at the first call otherwise)."""
        self._vocab = vocab
        rows = self.sizes[-1]
        self._seen = seen = SeenRows(rows, vocab, self.device, self.offset)
        self._inputs = inputs = _PackedInputs(rows, self.device, seen.trash)
        example = [((vocab,), torch.float32), ((COLUMNS,), torch.float32), ((), torch.long)]
        logits = self._given_logits
        if not _fits(logits, (rows, vocab), torch.float32, self.device):
            with torch.inference_mode(False):
                logits = torch.zeros(rows, vocab, dtype=torch.float32, device=self.device)
        ids = self._ids = self._given_ids if _fits(self._given_ids, (rows,), torch.long, self.device) else None
        self._logits = [logits[:k] for k in range(rows + 1)]
        with torch.inference_mode(False):  # seed, draws so far: the filtered graphs' noise (module docstring)
            rng = self._rng = torch.tensor([int(torch.randint(0, 2**62, ())), 0], dtype=torch.int64, device=self.device)
        self._graphs = {filtered: BatchGraphs(_marking(seen, filtered, self.offset, ids, rng if filtered else None,
                                                       self.masks),
                                              self.sizes, example, self.device,
                                              static_inputs=[logits, inputs.table, inputs.new])
                        for filtered in (False, True)}
        logger.info("sampling captured in CUDA graphs for batch sizes %s (vocabulary %d from id %d)", self.sizes,
                    vocab, self.offset)


def _fits(t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `t` holds at least shape[0] contiguous rows of shape[1:] in `dtype` on `device`."""
    return t is not None and t.dtype == dtype and t.device == device and t.is_contiguous() and \
        t.shape[0] >= shape[0] and tuple(t.shape[1:]) == shape[1:]


def _marking(seen: SeenRows, filtered: bool, offset: int, ids: torch.Tensor | None = None,
             rng: torch.Tensor | None = None, tokens: TokenMasks | None = None,
             ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The captured step: apply the staged token masks of structured outputs (`tokens`, in place), mark each
    row's new token (`new` [N]: flat mask indexes), then draw token ids (into the first rows of `ids` when
    given; with `rng`, `sample_static`'s seeded noise)."""
    flat, masks = seen.flat, seen.masks

    def step(logits: torch.Tensor, table: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        n = logits.shape[0]
        if tokens is not None:
            tokens.apply_(logits)
        if ids is None:
            columns = sample_static(logits, table, masks[:n], filtered, mark=(flat, new), rng=rng)
            return columns + offset if offset else columns
        # padding rows (a zero table row) may draw no valid column, and the next forward embeds every row
        # of its bucket, padding included: sample_static clamps each id inside the vocabulary
        return sample_static(logits, table, masks[:n], filtered, mark=(flat, new), out=ids[:n], offset=offset,
                             rng=rng)

    return step


class SeenRows:
    """Seen-token masks (prompt and output tokens, for the repetition penalty) of the rows a sampler
    graph replays, kept in one device buffer `masks` [R, V] across steps; token id t is column
    t - `offset`, ids outside [offset, offset + V) are left out.

    A row's mask is found through its sequence's sampling cache, with the keys `seen_masks` uses
    (`seen_batch` is `masks`, `seen_row` its row, `seen` the row's view, `seen_upto` the tokens
    marked), so eager sampling and the graphs can take turns on a sequence. While the rows are the
    same sequences in the same order (steady decoding) each step adds one token per row, and the
    replay marks it: `mark` writes its flat index (row * V + column) for the graph input, or `trash`
    (the element just past the masks) for none. A new batch composition first gathers the rows'
    masks into place (one stack, one copy); more than one new token in a row, which only follows a
    restart or a join, is marked by one eager index_fill_.
    """

    def __init__(self, rows: int, vocab: int, device: torch.device, offset: int = 0) -> None:
        with torch.inference_mode(False):
            self.flat = torch.zeros(rows * vocab + 1, dtype=torch.bool, device=device)
        self.masks = self.flat[: rows * vocab].view(rows, vocab)
        self.trash = rows * vocab
        self.vocab, self.device, self.offset = vocab, device, offset
        self._zero = torch.zeros(vocab, dtype=torch.bool, device=device)
        self._holders: list[dict | None] = [None] * rows  # the cache whose mask each row was given

    def mark(self, rows: Sequence[SamplingRow], new: np.ndarray, bucket: int) -> None:
        """Bring the masks of `rows` (batch rows 0..n-1) up to their tokens but one new token per row,
        whose flat index goes to new[i] (trash for none); new[n:bucket] := trash."""
        vocab, trash, lo = self.vocab, self.trash, self.offset
        hi = lo + vocab
        caches = [r.cache if r.cache is not None else {} for r in rows]
        if not self._in_place(caches):
            self._restack(rows, caches)
        flat, extra = [], []
        for i, (row, cache) in enumerate(zip(rows, caches)):
            tokens = row.token_ids
            n, upto = len(tokens), cache.get("seen_upto", 0)
            if upto > n:  # the sequence restarted: its mask is rebuilt from scratch
                self.masks[i].zero_()
                upto = 0
            if n - upto == 1 and lo <= (t := tokens[upto]) < hi:  # steady decoding: no slice, no generator
                flat.append(i * vocab + t - lo)
            else:
                flat.append(trash)
                if n - upto > 1:
                    extra.extend(i * vocab + t - lo for t in tokens[upto:] if lo <= t < hi)
            cache["seen_upto"] = n
        new[: len(flat)] = flat
        if bucket > len(flat):
            new[len(flat) : bucket] = trash
        if extra:  # index_fill_: no host scalar copied (a pageable copy would wait for the stream)
            self.flat.index_fill_(0, to_device_async(torch.tensor(extra, dtype=torch.long), self.device), True)

    def _in_place(self, caches: list[dict]) -> bool:
        """Whether row i of `masks` is the mask of caches[i], for every i (a plain loop: runs every step)."""
        masks = self.masks
        for i, cache in enumerate(caches):
            if cache.get("seen_batch") is not masks or cache.get("seen_row") != i:
                return False
        return True

    def _restack(self, rows: Sequence[SamplingRow], caches: list[dict]) -> None:
        """Gather the masks of `caches` into rows 0..n-1 (new or restarted sequences: empty). A sequence
        whose row is overwritten and is not in the batch loses its mask: it is rebuilt from its tokens
        if it comes back."""
        sources = []
        for row, cache in zip(rows, caches):
            seen = cache.get("seen")
            if seen is None or seen.shape != (self.vocab,) or seen.device != self.device \
                    or cache.get("seen_upto", 0) > len(row.token_ids):
                seen, cache["seen_upto"] = self._zero, 0
            sources.append(seen)
        n = len(caches)
        self.masks[:n].copy_(torch.stack(sources))  # every source read before any row is overwritten
        incoming = {id(c) for c in caches}
        for j, held in enumerate(self._holders):
            if held is None or id(held) in incoming:
                self._holders[j] = None  # moved (or left as it was): set again below
            elif j < n and held.get("seen_batch") is self.masks and held.get("seen_row") == j:
                for key in ("seen", "seen_batch", "seen_row"):
                    held.pop(key, None)
                held["seen_upto"] = 0
                self._holders[j] = None
        for i, cache in enumerate(caches):
            cache["seen_batch"], cache["seen_row"], cache["seen"] = self.masks, i, self.masks[i]
            self._holders[i] = cache


class _HostInputs:
    """One pinned staging set of `_PackedInputs`, with the params its table rows were built from."""

    def __init__(self, size: int, rows: int, new_at: int, pinned: bool, trash: int) -> None:
        with torch.inference_mode(False):
            self.buffer = torch.zeros(size, dtype=torch.uint8, pin_memory=pinned)
        self.spans = [self.buffer[: new_at + 8 * k] for k in range(rows + 1)]  # what a call of k rows sends
        self.table_np = self.buffer[: rows * COLUMNS * 4].view(torch.float32).view(rows, COLUMNS).numpy()
        self.new_np = self.buffer[new_at : new_at + rows * 8].view(torch.int64).numpy()
        self.new_np[:] = trash
        self.params: list[SamplingParams] | None = None
        self.repetition = self.filtered = False
        self.event = torch.cuda.Event() if pinned else None


class _PackedInputs:
    """The graph's static table [R, COLUMNS] float32 and new-token indexes [R] int64, as views of one
    device buffer filled by one copy per call from one of two pinned host sets."""

    def __init__(self, rows: int, device: torch.device, trash: int) -> None:
        new_at = -(-rows * COLUMNS * 4 // 256) * 256
        size = new_at + rows * 8
        with torch.inference_mode(False):
            self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
            self.table = self.buffer[: rows * COLUMNS * 4].view(torch.float32).view(rows, COLUMNS)
            self.new = self.buffer[new_at:].view(torch.int64)
            self.new.fill_(trash)  # the warm-up before capture replays these: they must mark nothing
            self.table_rows = [self.table[:k] for k in range(rows + 1)]
            self.new_rows = [self.new[:k] for k in range(rows + 1)]
            self._spans = [self.buffer[: new_at + 8 * k] for k in range(rows + 1)]
        self._rows, self._size, self._new_at, self._trash = rows, size, new_at, trash
        self._sets = [self.staging() for _ in range(2)]
        self._turn = 0

    def staging(self) -> _HostInputs:
        """A pinned host set of this layout (plain memory off CUDA)."""
        return _HostInputs(self._size, self._rows, self._new_at, self.buffer.is_cuda, self._trash)

    def span(self, bucket: int) -> torch.Tensor:
        """The device bytes a call of `bucket` rows reads (the table, new[:bucket])."""
        return self._spans[bucket]

    def next_host(self) -> _HostInputs:
        """The host set to stage the next call in (its previous copy done)."""
        host = self._sets[self._turn]
        self._turn ^= 1
        if host.event is not None:
            host.event.synchronize()  # queued two calls ago, before ids the caller has read since
        return host

    def send(self, host: _HostInputs, bucket: int) -> None:
        """Queue the copy of the table and of new[:bucket] to the device."""
        self._spans[bucket].copy_(host.spans[bucket], non_blocking=True)
        if host.event is not None:
            host.event.record()
