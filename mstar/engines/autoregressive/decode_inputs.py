"""Every input of a replayed decode step in one device buffer, filled by one copy per step.

A decode graph replay reads token ids and positions (the graph's static inputs) and the attention
backend's slot ids, sequence lengths and block tables. Sent one by one, that is five small host
tensors and as many copies and dispatcher calls per step, several microseconds each on a slow host,
where the host's share of a step is on the critical path. Here they are fields of one byte buffer on
the device: the decode graphs read views of it (`BatchGraphs(static_inputs=...)`) and so does an
attention backend that can share its decode buffers (`TritonBackend.share_decode_buffers`). A step
writes the fields into pinned host memory with numpy and sends them in ONE non-blocking copy.

Layout (fields 256-byte aligned; M rows, P pages per block-table row):

    ids int64[M] | positions int64[M] | slots int64[M] | seq_lens int32[M] | tables int32[M, P]

A step of n rows padded to `bucket` copies from `ids` (from `positions` when its ids come from the
device) to the end of table row n. Rows [n, bucket) are padding: slot -1 and length 0, so the kernels
write and read nothing for them; rows past `bucket` are never read.

Two pinned host sets are used in turn. Each records an event after its copy and waits for it before
it is rewritten, so a step staged while an earlier one may still be copying never overwrites it; the
wait is for a copy queued two stagings earlier, which the host has normally waited past already.
A caller that copies a set in itself (a step graph, `step_graph.py`) makes its own (`staging`), stages
into it with `send=False` and copies `span(bucket)` of it to the same span of the device buffer.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from mstar.engines.autoregressive.sequence import Sequence

_ALIGN = 256


def _layout(rows: int, max_pages: int) -> tuple[dict[str, int], int]:
    """Byte offset of each field, and the total size."""
    sizes = {"ids": 8 * rows, "positions": 8 * rows, "slots": 8 * rows, "seq_lens": 4 * rows,
             "tables": 4 * rows * max_pages}
    offsets, end = {}, 0
    for name, size in sizes.items():
        offsets[name] = end
        end += -(-size // _ALIGN) * _ALIGN
    return offsets, end


class _Fields:
    """Typed views (ids, positions, slots, seq_lens, tables) of one packed byte buffer."""

    def __init__(self, buffer: torch.Tensor, rows: int, max_pages: int, offsets: dict[str, int]) -> None:
        def field(name: str, dtype: torch.dtype, count: int) -> torch.Tensor:
            start = offsets[name]
            return buffer[start : start + count * dtype.itemsize].view(dtype)

        self.buffer = buffer
        self.ids = field("ids", torch.int64, rows)
        self.positions = field("positions", torch.int64, rows)
        self.slots = field("slots", torch.int64, rows)
        self.seq_lens = field("seq_lens", torch.int32, rows)
        self.tables = field("tables", torch.int32, rows * max_pages).view(rows, max_pages)


class HostSet(_Fields):
    """One pinned staging set: the fields as tensors and numpy arrays, the block-table rows it holds,
    and the event that marks its last copy done (None off CUDA)."""

    def __init__(self, rows: int, max_pages: int, offsets: dict[str, int], size: int, pinned: bool) -> None:
        with torch.inference_mode(False):
            super().__init__(torch.zeros(size, dtype=torch.uint8, pin_memory=pinned), rows, max_pages, offsets)
        self.spans: dict[tuple[int, int], torch.Tensor] = {}  # byte ranges copied so far, sliced once
        self.ids_np, self.positions_np, self.slots_np = self.ids.numpy(), self.positions.numpy(), self.slots.numpy()
        self.seq_lens_np, self.tables_np = self.seq_lens.numpy(), self.tables.numpy()
        self.event = torch.cuda.Event() if pinned else None
        self.slots_np[:] = -1  # an unstaged set describes rows that write nothing (as the device buffer starts)
        # per block-table row: the page list it was last written from, and how many of its pages
        self.table_rows: list[tuple[list[int] | None, int]] = [(None, 0)] * rows

    def write_table_row(self, i: int, pages: list[int]) -> None:
        """Block-table row i := `pages`. A sequence's page list only grows in place (the batch
        scheduler appends, and gives a new list when it frees them), so while row i holds the same list
        only the pages appended since are written: rewriting a whole row costs microseconds per sequence.
        The list is kept referenced, so its identity cannot pass to another list. Stale page ids past
        the sequence's own pages stay: the kernels stop at the sequence length."""
        held, done = self.table_rows[i]
        if held is not pages or done > len(pages):
            done = 0
        if done < len(pages):
            self.tables_np[i, done : len(pages)] = pages[done:]
            self.table_rows[i] = (pages, len(pages))


class DecodeInputs(_Fields):
    """The packed device buffer of decode inputs (module docstring) and its two pinned host sets.

    The fields (`ids`, `positions`, `slots`, `seq_lens`, `tables`) are device tensors; `ids_rows[n]`
    and `positions_rows[n]` are their first n rows, made once (a slice per step costs a dispatch).
    """

    def __init__(self, rows: int, max_pages: int, page_size: int, device: torch.device) -> None:
        offsets, size = _layout(rows, max_pages)
        with torch.inference_mode(False):  # normal tensors: eager callers may update the backend's views
            super().__init__(torch.zeros(size, dtype=torch.uint8, device=device), rows, max_pages, offsets)
            self.slots.fill_(-1)
            self.ids_rows = [self.ids[:k] for k in range(rows + 1)]
            self.positions_rows = [self.positions[:k] for k in range(rows + 1)]
        self.rows, self.max_pages, self.page_size = rows, max_pages, page_size
        self._offsets = offsets
        self._sets = [self.staging() for _ in range(2)]
        self._turn = 0
        self._positions_at, self._tables_at, self._row_bytes = offsets["positions"], offsets["tables"], 4 * max_pages
        self._spans: dict[tuple[int, int], torch.Tensor] = {}  # device byte ranges copied to, sliced once

    def staging(self) -> HostSet:
        """A pinned host set of this buffer's layout for a caller that copies it in itself (`stage(...,
        host=, send=False)`, then `span`); rewritten only by that caller's stagings."""
        return HostSet(self.rows, self.max_pages, self._offsets, self.buffer.numel(), self.buffer.is_cuda)

    def span(self, bucket: int, host: HostSet | None = None) -> torch.Tensor:
        """The bytes a whole staging of `bucket` rows without ids fills (positions to the end of table row
        `bucket`): of the device buffer, or of `host`."""
        buffer = self.buffer if host is None else host.buffer
        return buffer[self._positions_at : self._tables_at + self._row_bytes * bucket]

    def stage(self, seqs: Seq[Sequence], positions: list[int], with_ids: bool, bucket: int,
              whole: bool, host: HostSet | None = None, send: bool = True) -> HostSet:
        """Write one decode row per sequence at `positions` (ids: each sequence's own token there, when
        `with_ids`) into the next host set (or `host`), padded to `bucket` rows, and queue one copy to the
        device: of every field when `whole`, else of the ids and positions only (the caller sends slots
        and tables from the returned set its own way). The caller calls `sent` once all copies out of the
        set are queued. `send=False` queues no copy (the caller copies `span(bucket, host)` itself)."""
        if host is None:
            host = self._sets[self._turn]
            self._turn ^= 1
            if host.event is not None:
                host.event.synchronize()  # its copy was queued two stagings ago: normally long done
        n, page = len(seqs), self.page_size
        padded = bucket > n
        if with_ids:
            host.ids_np[:n] = [seq.token_ids[p] for seq, p in zip(seqs, positions)]
        host.positions_np[:n] = positions
        host.slots_np[:n] = [seq.pages[p // page] * page + p % page for seq, p in zip(seqs, positions)]
        if padded:
            host.ids_np[n:bucket] = 0
            host.positions_np[n:bucket] = 0
            host.slots_np[n:bucket] = -1
        rows = host.table_rows
        for i, seq in enumerate(seqs):
            held, done = rows[i]
            if held is not seq.pages or done != len(held):
                host.write_table_row(i, seq.pages)
        if whole:
            host.seq_lens_np[:n] = [p + 1 for p in positions]
            if padded:
                host.seq_lens_np[n:bucket] = 0
            end = self._tables_at + self._row_bytes * n
        else:
            end = self._positions_at + 8 * bucket
        if not send:
            return host
        span = (0 if with_ids else self._positions_at, end)
        target = self._spans.get(span)
        if target is None:
            target = self._spans[span] = self.buffer[span[0] : span[1]]
        source = host.spans.get(span)
        if source is None:
            source = host.spans[span] = host.buffer[span[0] : span[1]]
        target.copy_(source, non_blocking=True)
        return host

    def sent(self, host: HostSet) -> None:
        """Mark every copy out of `host` queued: it is rewritten only once they are done."""
        if host.event is not None:
            host.event.record()
