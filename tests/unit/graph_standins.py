"""CPU stand-ins for the CUDA-graph pieces of the decode path, faithful to what a replay reads.

`EagerBatchGraphs` has BatchGraphs' constructor and call; the constructor runs the function once per size
(largest first, after `before_capture`), as BatchGraphs' warm-up does; a call copies inputs into the
static inputs (none for an input that already is its shared static, as BatchGraphs does) and runs the
function eagerly on the static inputs of the whole bucket, padded rows included, as a replay would.
`PoolGraphs` also returns its outputs as a replay does: views of buffers that the next replay, of any size,
rewrites (the sizes of one BatchGraphs share a memory pool), so a caller that keeps an output past the next
call reads another step's values.
`SharedSDPA` is the SDPA backend with the Triton backend's decode-buffer sharing: a staged decode
batch is read back from the shared buffers (lengths, slots, block tables) when its first layer runs,
as the kernels read them (a step graph copies them in after `prepare_staged_decode`).
"""

from __future__ import annotations

import torch

from mstar.engines.attention.base import AttentionMetadata
from mstar.engines.attention.sdpa import SDPABackend


class EagerBatchGraphs:
    """BatchGraphs without CUDA (see the module docstring); counts calls and input copies."""

    def __init__(self, fn, sizes, example, device, before_capture=None, warmup=2, static_inputs=None):
        self.fn, self.sizes, self.device = fn, sorted(set(sizes)), torch.device(device)
        shared = list(static_inputs) if static_inputs is not None else [None] * len(example)
        self.statics = [s if s is not None else torch.zeros((self.sizes[-1], *shape), dtype=dtype, device=device)
                        for s, (shape, dtype) in zip(shared, example)]
        self.calls = self.copies = 0
        for size in reversed(self.sizes):  # BatchGraphs' warm-up: state made at a first call exists after
            if before_capture is not None:
                before_capture(size)
            with torch.inference_mode():
                fn(*(s[:size] for s in self.statics))

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    def __call__(self, *inputs, bucket=None):
        batch = inputs[0].shape[0]
        size = bucket or self.bucket(batch)
        assert size is not None and size >= batch
        self.calls += 1
        with torch.inference_mode():
            for static, value in zip(self.statics, inputs):
                if value.data_ptr() != static.data_ptr():
                    static[:batch].copy_(value)
                    self.copies += 1
            out = self.fn(*(s[:size] for s in self.statics))
        outs = out if isinstance(out, tuple) else (out,)
        return tuple(o[:batch] for o in outs)


class PoolGraphs(EagerBatchGraphs):
    """EagerBatchGraphs whose outputs are views of buffers every call rewrites (see the module docstring);
    rows past the batch are filled with a marker, as padded rows hold whatever the replay left there."""

    def __init__(self, *args, **kwargs):
        self.outputs = None
        super().__init__(*args, **kwargs)

    def __call__(self, *inputs, bucket=None):
        outs = super().__call__(*inputs, bucket=bucket)
        batch = inputs[0].shape[0]
        with torch.inference_mode():  # as a replay writes its pool: whether or not the caller is in it
            if self.outputs is None:
                self.outputs = [torch.empty((self.sizes[-1], *o.shape[1:]), dtype=o.dtype) for o in outs]
            for buffer, out in zip(self.outputs, outs, strict=True):
                buffer.fill_(-7)
                buffer[:batch].copy_(out)
        return tuple(buffer[:batch] for buffer in self.outputs)


class SharedSDPA(SDPABackend):
    """SDPABackend that can share its decode buffers like TritonBackend (see the module docstring)."""

    def __init__(self, layout, num_pages, page_size, device, max_num_seqs, max_pages_per_seq):
        super().__init__(layout, num_pages, page_size, device)
        self.max_num_seqs, self.max_pages_per_seq = max_num_seqs, max_pages_per_seq
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32)
        self.slot_mapping = torch.full((max_num_seqs,), -1, dtype=torch.int64)
        self.block_tables = torch.zeros(max_num_seqs, max_pages_per_seq, dtype=torch.int32)
        self.staged = 0  # decode batches read back from the shared buffers
        self._rows, self._pending = None, False

    def share_decode_buffers(self, seq_lens, slot_mapping, block_tables):
        assert seq_lens.shape == self.seq_lens.shape and block_tables.shape == self.block_tables.shape
        self.seq_lens, self.slot_mapping, self.block_tables = seq_lens, slot_mapping, block_tables

    def prepare(self, meta, pad_to=None):
        self._rows, self._pending = None, False
        super().prepare(meta)

    def prepare_staged_decode(self, num_seqs, rows):
        self._rows, self._pending = (num_seqs, rows), True  # read back at the first layer, as kernels read

    def _read_back(self):
        num_seqs, rows = self._rows
        lens, slots = self.seq_lens[:rows].tolist(), self.slot_mapping[:rows].tolist()
        assert lens[num_seqs:] == [0] * (rows - num_seqs) and slots[num_seqs:] == [-1] * (rows - num_seqs)
        width = max(-(-n // self.page_size) for n in lens[:num_seqs])
        super().prepare(AttentionMetadata([1] * num_seqs, lens[:num_seqs], self.slot_mapping[:num_seqs].clone(),
                                          self.block_tables[:num_seqs, :width].clone()))
        self._pending = False
        self.staged += 1

    def forward(self, layer, q, k, v):
        if self._rows is None:
            return super().forward(layer, q, k, v)
        if self._pending:
            self._read_back()
        n, rows = self._rows
        assert q.shape[0] == rows, (q.shape, rows)  # a replay runs the whole bucket
        out = super().forward(layer, q[:n], k[:n], v[:n])
        return torch.cat([out, out.new_zeros(rows - n, *out.shape[1:])])
