"""The pinned staging of a graphed decode step writes a block-table row only where its pages changed:
whatever the order of page appends, list replacements (preemption) and row moves, every row reads
as if it had been rewritten whole."""

import random

from mstar.engines.autoregressive.runner import _DecodeStaging


def _row(st: _DecodeStaging, i: int, n: int) -> list[int]:
    return st.tables_np[i, :n].tolist()


def test_rows_follow_appends_replacements_and_moves():
    st = _DecodeStaging(max_batch=4, max_pages=8)
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
    st = _DecodeStaging(max_batch=6, max_pages=40)
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
