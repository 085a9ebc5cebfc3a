"""Triton paged-attention kernels (interpreted on CPU) against SDPABackend on random paged batches.

Triton reads TRITON_INTERPRET when kernels are decorated, so the kernels run in one subprocess
(tests/unit/paged_attention_cases.py) that reports the errors of every case; this process never
imports them.
"""

import json
from pathlib import Path

import pytest
import torch

from mstar.engines.attention.base import AttentionMetadata
from mstar.engines.attention.sdpa import SDPABackend
from mstar.engines.autoregressive.runner import make_attention_backend
from mstar.engines.base import KVLayout
from tests.interpreted import run_interpreted

pytest.importorskip("triton")

HERE = Path(__file__).parent
CASES = ["mixed_gqa4_causal", "mixed_mha_causal", "non_causal", "sliding_window", "decode_one_split",
         "decode_splits", "decode_window_splits", "decode_padded", "decode_padded_one_split", "decode_staged",
         "mixed_fp16"]


@pytest.fixture(scope="module")
def results() -> dict:
    proc = run_interpreted(HERE / "paged_attention_cases.py", *CASES, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", CASES)
def test_matches_sdpa(results: dict, name: str) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    tol = 5e-3 if "fp16" in name else 2e-5
    assert r["out"] <= tol * max(1.0, r["ref_scale"]), r
    assert r["k_cache"] == 0 and r["v_cache"] == 0, r  # same slots written, padding rows skipped
    assert r["pad_rows"] == 0, r


def _backend(monkeypatch, **kw):
    from mstar.engines.attention.triton_backend import TritonBackend

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets the backend be built on CPU; kernels stay unloaded
    return TritonBackend(KVLayout(1, 2, 8, torch.float32), num_pages=16, page_size=4, device="cpu", **kw)


def _meta(query_lens, seq_lens, width=4):
    tables = torch.arange(len(seq_lens) * width, dtype=torch.int32).view(-1, width) % 16
    return AttentionMetadata(query_lens, seq_lens, torch.arange(sum(query_lens)), tables)


def test_prepare_pads_decode_rows(monkeypatch) -> None:
    b = _backend(monkeypatch, max_num_seqs=8, max_pages_per_seq=4)
    b.prepare(_meta([1, 1, 1], [5, 9, 13]), pad_to=6)
    assert b.is_decode and b.num_rows == 6
    assert b.seq_lens[:6].tolist() == [5, 9, 13, 0, 0, 0]
    assert b.slot_mapping[:6].tolist() == [0, 1, 2, -1, -1, -1]
    b.prepare(_meta([3, 1], [7, 2]))
    assert not b.is_decode and b.q_starts[:3].tolist() == [0, 3, 4] and b.seq_lens[:2].tolist() == [7, 2]


def test_prepare_rejects_bad_batches(monkeypatch) -> None:
    b = _backend(monkeypatch, max_num_seqs=4, max_pages_per_seq=4)
    with pytest.raises(ValueError, match="decode-only"):
        b.prepare(_meta([2, 1], [5, 9]), pad_to=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        b.prepare(_meta([1, 1], [5, 9]), pad_to=8)
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        b.prepare(_meta([1], [17], width=5))


def test_backend_names_on_cpu(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layout = KVLayout(1, 2, 8, torch.float32)
    assert isinstance(make_attention_backend("auto", layout, 8, 4, torch.device("cpu")), SDPABackend)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_attention_backend("triton", layout, 8, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="available"):
        make_attention_backend("flash", layout, 8, 4, torch.device("cpu"))


def test_staged_decode_equals_prepare(monkeypatch) -> None:
    """A decode batch staged in the runner's packed buffer (shared with the backend) leaves the backend
    reading what `prepare(meta, pad_to)` gives it, also after a prefill prepared the usual way."""
    from mstar.engines.autoregressive.decode_inputs import DecodeInputs
    from mstar.engines.autoregressive.sequence import Sequence
    from mstar.engines.sampling import SamplingParams

    own = _backend(monkeypatch, max_num_seqs=8, max_pages_per_seq=4)
    shared = _backend(monkeypatch, max_num_seqs=8, max_pages_per_seq=4)
    dec = DecodeInputs(8, 4, 4, torch.device("cpu"))
    shared.share_decode_buffers(dec.seq_lens, dec.slots, dec.tables)
    for b in (own, shared):  # a prefill first: the shared buffers take eager prepares too
        b.prepare(_meta([3, 1], [7, 2]))
    assert shared.seq_lens[:2].tolist() == [7, 2] and dec.seq_lens[:2].tolist() == [7, 2]
    seqs = []
    for i, length in enumerate((5, 9, 13)):
        seq = Sequence((f"r{i}", "main"), SamplingParams(), list(range(length)), length)
        seq.pages = [(3 * i + j) % 16 for j in range(-(-length // 4))]
        seqs.append(seq)
    positions = [len(s.token_ids) - 1 for s in seqs]
    host = dec.stage(seqs, positions, True, 4, whole=True)
    dec.sent(host)
    shared.prepare_staged_decode(3, 4)
    tables = torch.tensor([s.pages + [0] * (4 - len(s.pages)) for s in seqs], dtype=torch.int32)
    slots = torch.tensor([s.pages[p // 4] * 4 + p % 4 for s, p in zip(seqs, positions)])
    own.prepare(AttentionMetadata([1] * 3, [p + 1 for p in positions], slots, tables), pad_to=4)
    for name in ("is_decode", "num_rows", "_num_seqs", "_max_query_len", "_causal", "_window"):
        assert getattr(shared, name) == getattr(own, name), name
    assert shared.seq_lens[:4].tolist() == own.seq_lens[:4].tolist() == [5, 9, 13, 0]
    assert shared._slots.tolist() == own._slots.tolist() == slots.tolist() + [-1]
    for i, s in enumerate(seqs):
        assert shared.block_tables[i, : len(s.pages)].tolist() == own.block_tables[i, : len(s.pages)].tolist()


def test_share_decode_buffers_checks_shapes(monkeypatch) -> None:
    from mstar.engines.autoregressive.decode_inputs import DecodeInputs

    b = _backend(monkeypatch, max_num_seqs=8, max_pages_per_seq=4)
    dec = DecodeInputs(8, 5, 4, torch.device("cpu"))  # one page too wide
    with pytest.raises(ValueError, match="block_tables"):
        b.share_decode_buffers(dec.seq_lens, dec.slots, dec.tables)
