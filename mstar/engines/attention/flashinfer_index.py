"""Our batch description (block tables, sequence lengths) in FlashInfer's paged-KV form, on the host.

FlashInfer describes the pages of a batch in CSR form: row i's pages are
`indices[kv_indptr[i]:kv_indptr[i + 1]]`, of which the last holds `last_page_len[i]` tokens
(1..page_size), and its query tokens are `q[qo_indptr[i]:qo_indptr[i + 1]]`. This module computes
those arrays from `AttentionMetadata` fields with numpy alone (no device work, no sync); the backend
turns `gather` into page ids with one gather on whichever device holds the block table.

Padded rows (CUDA-graph decode buckets) get one query token over one page: the backend's scratch
page, which no sequence owns, so they never read or write another sequence's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PagedIndex:
    """FlashInfer's description of one batch of `rows` rows (real ones first, then padding)."""

    qo_indptr: np.ndarray  # [rows + 1] int32: query token offsets of each row in the packed q
    kv_indptr: np.ndarray  # [rows + 1] int32: page offsets of each row in `indices`
    last_page_len: np.ndarray  # [rows] int32: tokens in each row's last page, 1..page_size
    gather: np.ndarray  # [pages of real rows] int64: flat block-table positions (row * width + j)
    num_pad_pages: int  # pages of padded rows (one each), after the gathered ones in `indices`


def paged_index(query_lens: list[int], seq_lens: list[int], page_size: int, table_width: int,
                rows: int | None = None) -> PagedIndex:
    """The CSR arrays for a batch whose block table is [len(seq_lens), table_width], padded to `rows`.

    Raises ValueError when a sequence is empty, its query is longer than the sequence, or its pages
    do not fit in the block table.
    """
    num_seqs = len(seq_lens)
    rows = num_seqs if rows is None else rows
    if len(query_lens) != num_seqs or rows < num_seqs:
        raise ValueError(f"{len(query_lens)} query lengths, {num_seqs} sequence lengths, {rows} rows: "
                         "give one query and one sequence length per sequence, rows >= sequences")
    seq = np.asarray(seq_lens, dtype=np.int64)
    qlen = np.asarray(query_lens, dtype=np.int64)
    if num_seqs and (seq.min() < 1 or (qlen < 1).any() or (qlen > seq).any()):
        raise ValueError(f"query_lens={query_lens} seq_lens={seq_lens}: every sequence needs "
                         "1 <= query_len <= seq_len")
    pages = -(-seq // page_size)
    if num_seqs and pages.max() > table_width:
        raise ValueError(f"a sequence of {int(seq.max())} tokens needs {int(pages.max())} pages but the "
                         f"block table has {table_width} columns")
    pad = rows - num_seqs
    qo = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(np.concatenate([qlen, np.ones(pad, dtype=np.int64)]), out=qo[1:])
    kv = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(np.concatenate([pages, np.ones(pad, dtype=np.int64)]), out=kv[1:])
    last = np.ones(rows, dtype=np.int32)
    last[:num_seqs] = seq - (pages - 1) * page_size
    real_pages = int(pages.sum())
    starts = np.repeat(kv[:num_seqs].astype(np.int64), pages)  # first page offset of each page's row
    row_of_page = np.repeat(np.arange(num_seqs, dtype=np.int64), pages)
    gather = row_of_page * table_width + (np.arange(real_pages, dtype=np.int64) - starts)
    return PagedIndex(qo, kv, last, gather, pad)
