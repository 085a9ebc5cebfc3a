"""FlashInferBackend on CPU against SDPABackend, with `fake_flashinfer` standing in for the package.

The stand-in implements FlashInfer's documented wrapper semantics in plain torch, so these tests
check our adapter (CSR conversion, scratch page, slot writes, which wrapper is planned and run, the
graph-mode buffers) and the "auto" choice; they say nothing about FlashInfer's own kernels, which
tests/gpu/test_flashinfer_attention_gpu.py compares where flashinfer imports.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch

from mstar.engines.attention.base import AttentionMetadata
from mstar.engines.attention.flashinfer_index import paged_index
from mstar.engines.attention.sdpa import SDPABackend
from mstar.engines.autoregressive import runner
from mstar.engines.base import KVLayout
from tests.unit import fake_flashinfer
from tests.unit.flashinfer_cases import CASES, GQA4, MHA, compare, make_pair, run_case, tolerance
from tests.unit.paged_attention_cases import random_batch

CPU = dict(require_cuda=False, workspace_bytes=1024)


@pytest.fixture(autouse=True)
def fake(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    fake_flashinfer.CALLS.clear()
    return fake_flashinfer


def test_paged_index_matches_hand_worked_example() -> None:
    # page size 4; sequence 0: 6 tokens (2 pages), sequence 1: 4 tokens (1 full page); padded to 4 rows
    idx = paged_index([2, 1], [6, 4], page_size=4, table_width=3, rows=4)
    assert idx.qo_indptr.tolist() == [0, 2, 3, 4, 5]
    assert idx.kv_indptr.tolist() == [0, 2, 3, 4, 5]
    assert idx.last_page_len.tolist() == [2, 4, 1, 1]
    assert idx.gather.tolist() == [0, 1, 3]  # row 0 columns 0-1, row 1 column 0 of a width-3 table
    assert idx.num_pad_pages == 2
    assert all(a.dtype == np.int32 for a in (idx.qo_indptr, idx.kv_indptr, idx.last_page_len))


def test_paged_index_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        paged_index([3], [2], 4, 1)
    with pytest.raises(ValueError, match="block table has 1 columns"):
        paged_index([1], [5], 4, 1)
    with pytest.raises(ValueError, match="rows >= sequences"):
        paged_index([1, 1], [1, 1], 4, 1, rows=1)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_sdpa(name: str) -> None:
    r = run_case(**CASES[name], **CPU)
    case = CASES[name]
    assert r["out"] <= tolerance(case["shape"].dtype, r["ref_scale"]), r
    assert r["k_cache"] == 0 and r["v_cache"] == 0, r  # same slots written, padded rows only on scratch
    assert r["rows"] == (case.get("pad_to") or sum(case["query_lens"])) and r["pad_finite"], r


def test_steps_reuse_the_cache_they_wrote() -> None:
    """Chunked prefill then decode steps: each step attends over K/V that earlier steps stored."""
    sdpa, fib = make_pair(MHA, "cpu", **CPU)
    pages = [[5, 9, 2, 30, 31, 7], [11, 3, 4, 20, 21, 22]]
    table = torch.tensor(pages, dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    steps = [([4, 2], [0, 0]), ([5, 1], [4, 2]), ([1, 1], [9, 3]), ([1, 1], [10, 4])]  # (query lens, starts)
    for query_lens, starts in steps:
        slots = [pages[i][p // MHA.page_size] * MHA.page_size + p % MHA.page_size
                 for i, (n, s) in enumerate(zip(query_lens, starts)) for p in range(s, s + n)]
        meta = AttentionMetadata(query_lens, [s + n for n, s in zip(query_lens, starts)], torch.tensor(slots), table)
        q, k, v = (torch.randn(sum(query_lens), h, MHA.head_dim, generator=g).half() for h in (2, 2, 2))
        for layer in (0, 1):
            r = compare(sdpa, fib, meta, q, k, v, layer=layer)
            assert r["out"] <= tolerance(torch.float16, r["ref_scale"]) and r["k_cache"] == 0, r


def test_call_sequence_and_deferred_plan(fake) -> None:
    _, fib = make_pair(GQA4, "cpu", **CPU, self_check=False)
    meta, q, k, v = random_batch(GQA4, [9, 1, 13], [9, 1, 1], "cpu")
    fib.prepare(meta)
    assert fake.CALLS == [("init", "prefill", None)]  # query heads unknown yet: plan waits for q
    fib.forward(0, q, k, v)
    fib.forward(1, q, k, v)
    assert fake.CALLS[1:] == [("plan", "prefill", 3), ("run", "prefill", 3), ("run", "prefill", 3)]
    fake.CALLS.clear()
    meta, q, k, v = random_batch(GQA4, [9, 2], [1, 1], "cpu")
    fib.prepare(meta)  # heads known now: planned in prepare, outside any graph capture
    fib.forward(0, q, k, v)
    assert fake.CALLS == [("init", "decode", None), ("plan", "decode", 2), ("run", "decode", 2)]
    with pytest.raises(ValueError, match="planned for 4"):
        fib.forward(0, q[:, :2].contiguous(), k, v)


def test_graph_mode_wrappers_and_fixed_buffers(fake) -> None:
    _, fib = make_pair(GQA4, "cpu", **CPU, num_qo_heads=4)
    fake.CALLS.clear()
    buffers = []
    for lens, pad_to in (([5, 40], 4), ([70, 3, 9], 4), ([2], 8), ([33, 34, 35], 4)):
        meta, *_ = random_batch(GQA4, lens, [1] * len(lens), "cpu")
        fib.prepare(meta, pad_to=pad_to)
        b = fib._graph_buffers
        buffers.append((b.kv_indptr.data_ptr(), b.kv_indices.data_ptr(), b.slots.data_ptr()))
    inits = [c for c in fake.CALLS if c[0] == "init"]
    assert inits == [("init", "decode", 4), ("init", "decode", 8)]  # one graph wrapper per size, reused
    assert [c for c in fake.CALLS if c[0] == "plan"] == [("plan", "decode", n) for n in (4, 4, 8, 4)]
    assert len(set(buffers)) == 1  # captured graphs keep reading the same tensors
    assert fib._decode_graph[4].use_cuda_graph and fib._decode_graph[4].fixed_batch == 4


def test_dummy_capture_batch_writes_only_scratch() -> None:
    """The runner's capture batch: slots -1, block tables of zeros; nothing lands in the pool's pages."""
    _, fib = make_pair(GQA4, "cpu", **CPU)
    before = fib.k_cache[:, : GQA4.num_pages].clone()
    meta = AttentionMetadata([1] * 3, [1] * 3, torch.full((3,), -1), torch.zeros(3, 1, dtype=torch.int32))
    fib.prepare(meta, pad_to=4)
    k = torch.randn(4, 1, 64).half()
    out = fib.forward(0, torch.randn(4, 4, 64).half(), k, k)
    assert out.shape == (4, 4, 64) and torch.isfinite(out).all()
    assert torch.equal(fib.k_cache[:, : GQA4.num_pages], before)
    assert fib.k_cache[0, GQA4.num_pages, 0].abs().sum() > 0  # the scratch slot took the writes


def test_rejects_bad_batches_and_configs(fake, monkeypatch) -> None:
    _, fib = make_pair(GQA4, "cpu", **CPU, max_num_seqs=4)
    meta = random_batch(GQA4, [5, 9], [2, 1], "cpu")[0]
    with pytest.raises(ValueError, match="decode-only"):
        fib.prepare(meta, pad_to=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        fib.prepare(random_batch(GQA4, [5, 9], [1, 1], "cpu")[0], pad_to=8)
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        fib.prepare(random_batch(GQA4, [4 * 65], [1], "cpu")[0])
    layout = KVLayout(1, 2, 64, torch.float16)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        runner.make_attention_backend("flashinfer", layout, 8, 4, torch.device("cpu"))
    from mstar.engines.attention.flashinfer_backend import FlashInferBackend

    for bad, match in ((KVLayout(1, 2, 64, torch.float32), "float16/bfloat16"),
                       (KVLayout(1, 2, 48, torch.float16), "head_dim")):
        with pytest.raises(ValueError, match=match):
            FlashInferBackend(bad, 8, 4, "cpu", **CPU)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer now raises ImportError
    with pytest.raises(ImportError, match="pip install flashinfer-python"):
        FlashInferBackend(layout, 8, 4, "cpu", **CPU)


def test_auto_order_and_fallback(fake, monkeypatch, caplog) -> None:
    layout = KVLayout(1, 2, 64, torch.float16)
    assert isinstance(runner.make_attention_backend("auto", layout, 8, 4, torch.device("cpu")), SDPABackend)
    assert runner._auto_candidates(False) == ["sdpa"]
    # Triton first (validated on the H200), FlashInfer next until it has run on a GPU, SDPA last
    assert runner._auto_candidates(True) == ["triton", "flashinfer", "sdpa"]
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert "flashinfer" not in runner._auto_candidates(True)
    # FlashInfer importable but failing to initialise (here: no CUDA device): logged, next backend used
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(runner, "_auto_candidates", lambda on_cuda: ["flashinfer", "sdpa"])
    with caplog.at_level(logging.WARNING, logger=runner.__name__):
        backend = runner.make_attention_backend("auto", layout, 8, 4, torch.device("cpu"))
    assert isinstance(backend, SDPABackend)
    assert "'flashinfer' failed to initialise" in caplog.text and "needs a CUDA device" in caplog.text


def test_buffers_made_in_inference_mode_update_outside_it() -> None:
    """The engine prepares under inference mode; tests and tools may prepare outside it afterwards."""
    _, fib = make_pair(GQA4, "cpu", **CPU, num_qo_heads=4)
    meta, q, k, v = random_batch(GQA4, [5, 40], [1, 1], "cpu")
    with torch.inference_mode():
        fib.prepare(meta, pad_to=4)
    fib.prepare(meta, pad_to=4)  # rewrites the graph buffers and plans the same wrapper again
    pad = torch.zeros(2, *q.shape[1:], dtype=q.dtype)
    kpad = torch.zeros(2, *k.shape[1:], dtype=k.dtype)
    assert fib.forward(0, torch.cat([q, pad]), torch.cat([k, kpad]), torch.cat([v, kpad])).shape == (4, 4, 64)
