"""The packed decode inputs of a graphed decode step (engines/autoregressive/decode_inputs.py).

Block-table rows are written only where a sequence's pages changed, yet every row must read as if it
had been rewritten whole; and over any history of steps (sequences joining and leaving, pages
appended or replaced, batches padded to graph sizes, ids from the host or the device, the two host
sets taken in turn) the device buffer's fields must hold exactly what the per-tensor staging before
it sent: ids, positions, slot ids, sequence lengths (0 on padded rows, slot -1) and block tables.
"""

import random

import pytest
import torch

from mstar.engines.autoregressive.decode_inputs import DecodeInputs, HostSet, _layout
from mstar.engines.autoregressive.sequence import Sequence
from mstar.engines.sampling import SamplingParams


def _host(rows: int, max_pages: int) -> HostSet:
    offsets, size = _layout(rows, max_pages)
    return HostSet(rows, max_pages, offsets, size, pinned=False)


def _row(st: HostSet, i: int, n: int) -> list[int]:
    return st.tables_np[i, :n].tolist()


def test_rows_follow_appends_replacements_and_moves():
    st = _host(rows=4, max_pages=8)
    a, b = [3, 5], [7]
    st.write_table_row(0, a)
    st.write_table_row(1, b)
    assert _row(st, 0, 2) == [3, 5] and _row(st, 1, 1) == [7]
    a += [9]  # the scheduler appends in place
    st.write_table_row(0, a)
    assert _row(st, 0, 3) == [3, 5, 9]
    st.write_table_row(0, b)  # another sequence takes row 0
    st.write_table_row(1, a)
    assert _row(st, 0, 1) == [7] and _row(st, 1, 3) == [3, 5, 9]
    c = [1, 2, 4]  # preempted and readmitted: a new list of the same length
    st.write_table_row(1, c)
    assert _row(st, 1, 3) == [1, 2, 4]
    st.write_table_row(1, a)  # the old list again (still referenced by the staging)
    assert _row(st, 1, 3) == [3, 5, 9]


def test_random_histories_match_full_rewrites():
    rng = random.Random(0)
    st = _host(rows=6, max_pages=40)
    seqs = [[rng.randrange(1000)] for _ in range(10)]
    next_page = 1000
    for _ in range(3000):
        k = rng.randrange(len(seqs))
        op = rng.random()
        if op < 0.6 and len(seqs[k]) < 40:
            seqs[k] += [next_page]  # in place, like `seq.pages += pool.allocate(n)`
            next_page += 1
        elif op < 0.7:
            seqs[k] = [rng.randrange(1000) for _ in range(rng.randrange(1, 5))]  # freed, new list
        batch = rng.sample(range(len(seqs)), rng.randrange(1, 7))
        for i, s in enumerate(batch):
            st.write_table_row(i, seqs[s])
        for i, s in enumerate(batch):
            assert _row(st, i, len(seqs[s])) == seqs[s]


def test_fields_are_aligned_views_of_one_buffer():
    dec = DecodeInputs(rows=5, max_pages=7, page_size=4, device=torch.device("cpu"))
    base = dec.buffer.data_ptr()
    for field in (dec.ids, dec.positions, dec.slots, dec.seq_lens, dec.tables):
        assert field.untyped_storage().data_ptr() == dec.buffer.untyped_storage().data_ptr()
        assert (field.data_ptr() - base) % 256 == 0
    assert dec.tables.shape == (5, 7) and dec.tables.dtype == torch.int32 and dec.seq_lens.dtype == torch.int32
    assert dec.slots.tolist() == [-1] * 5  # nothing staged yet: every row writes nowhere
    assert dec.ids_rows[3].data_ptr() == dec.ids.data_ptr() and dec.ids_rows[3].shape == (3,)


class _History:
    """Sequences that decode, grow pages (in place), get preempted (new page list), join and leave."""

    def __init__(self, rng: random.Random, page_size: int, max_pages: int) -> None:
        self.rng, self.page, self.max_pages = rng, page_size, max_pages
        self.next_page = 0
        self.live: list[Sequence] = []

    def _pages(self, n: int) -> list[int]:
        self.next_page += n
        return list(range(self.next_page - n, self.next_page))

    def join(self) -> None:
        tokens = [self.rng.randrange(50_000) for _ in range(self.rng.randrange(1, 3 * self.page))]
        seq = Sequence((f"r{self.next_page}", "main"), SamplingParams(), tokens, len(tokens))
        seq.pages = self._pages(-(-(len(tokens) + 1) // self.page))
        self.live.insert(self.rng.randrange(len(self.live) + 1), seq)

    def advance(self) -> None:
        """Each live sequence gets one more token; pages appended in place when it crosses a page."""
        for seq in self.live:
            if (len(seq.token_ids) + 1) // self.page + 1 > self.max_pages:
                continue
            seq.token_ids.append(self.rng.randrange(50_000))
            need = -(-(len(seq.token_ids) + 1) // self.page) - len(seq.pages)
            if need > 0:
                seq.pages += self._pages(need)

    def preempt(self) -> None:
        seq = self.rng.choice(self.live)
        seq.pages = self._pages(len(seq.pages))  # freed, readmitted on other pages: a new list


def _expected(seqs, positions, ids, bucket, page):
    """What the per-tensor staging sent (and `prepare(meta, pad_to=bucket)` padded)."""
    n = len(seqs)
    slots = [s.pages[p // page] * page + p % page for s, p in zip(seqs, positions)]
    return {"ids": ids, "positions": positions, "slots": slots + [-1] * (bucket - n),
            "seq_lens": [p + 1 for p in positions] + [0] * (bucket - n)}


@pytest.mark.parametrize("whole", [True, False])
def test_packed_buffer_equals_per_tensor_staging_over_a_history(whole):
    rng = random.Random(1 if whole else 2)
    page, max_pages, sizes = 4, 12, [1, 2, 4, 8]
    dec = DecodeInputs(rows=8, max_pages=max_pages, page_size=page, device=torch.device("cpu"))
    hist = _History(rng, page, max_pages)
    for _ in range(3):
        hist.join()
    for step in range(400):
        r = rng.random()
        if r < 0.08 and len(hist.live) < 8:
            hist.join()
        elif r < 0.14 and len(hist.live) > 1:
            hist.live.pop(rng.randrange(len(hist.live)))  # leaves: the rows after it move up
        elif r < 0.18:
            hist.preempt()
        hist.advance()
        seqs = list(hist.live)
        n = len(seqs)
        bucket = next(s for s in sizes if s >= n)
        lookahead = step % 3 == 0  # ids from the device, positions one past the last token
        positions = [len(s.token_ids) if lookahead else len(s.token_ids) - 1 for s in seqs]
        host = dec.stage(seqs, positions, not lookahead, bucket, whole)
        if lookahead:  # what the sampler drew, on the device: the caller copies it in
            ids = [rng.randrange(50_000) for _ in seqs]
            dec.ids_rows[n].copy_(torch.tensor(ids))
        else:
            ids = [s.token_ids[p] for s, p in zip(seqs, positions)]
        dec.sent(host)
        want = _expected(seqs, positions, ids, bucket, page)
        assert dec.ids[:n].tolist() == want["ids"]
        assert dec.positions[:n].tolist() == want["positions"]
        # whole: the device holds them; else the backend copies them from the host set
        fields = dec if whole else host
        assert fields.slots[:n].tolist() == want["slots"][:n]
        if whole:
            assert dec.slots[:bucket].tolist() == want["slots"]
            assert dec.seq_lens[:bucket].tolist() == want["seq_lens"]
        for i, s in enumerate(seqs):
            assert fields.tables[i, : len(s.pages)].tolist() == s.pages, (step, i)
