"""Random paged-attention batches run through TritonBackend and SDPABackend side by side.

Shared by tests/unit/test_triton_attention.py (which runs this file as a script under
TRITON_INTERPRET=1, since triton reads that variable when kernels are decorated) and
tests/gpu/test_triton_attention.py (CUDA, bf16, realistic sizes). Torch-only at import time.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import dataclass

import torch

from mstar.engines.attention.base import AttentionMetadata
from mstar.engines.attention.sdpa import SDPABackend
from mstar.engines.base import KVLayout


@dataclass(frozen=True)
class Shape:
    """Head counts, head size, paging and dtype of one comparison."""

    hq: int = 8
    hkv: int = 2
    head_dim: int = 16
    page_size: int = 4
    num_pages: int = 160
    max_pages_per_seq: int = 64
    dtype: torch.dtype = torch.float32
    num_layers: int = 2


def make_pair(shape: Shape, device: str, seed: int = 0, num_sms: int | None = None, max_num_seqs: int = 16):
    """(sdpa, triton) backends whose caches hold the same random values in every page."""
    from mstar.engines.attention.triton_backend import TritonBackend

    layout = KVLayout(shape.num_layers, shape.hkv, shape.head_dim, shape.dtype)
    sdpa = SDPABackend(layout, shape.num_pages, shape.page_size, device)
    tri = TritonBackend(layout, shape.num_pages, shape.page_size, device, max_num_seqs=max_num_seqs,
                        max_pages_per_seq=shape.max_pages_per_seq)
    if num_sms is not None:
        tri.num_sms = num_sms
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: GPU pools are large
    for cache in ("k_cache", "v_cache"):
        values = torch.randn(getattr(sdpa, cache).shape, generator=g, device=device).to(shape.dtype)
        getattr(sdpa, cache).copy_(values)
        getattr(tri, cache).copy_(values)
    return sdpa, tri


def random_batch(shape: Shape, seq_lens, query_lens, device: str, seed: int = 1, causal: bool = True,
                 window: int | None = None):
    """(meta, q, k, v) for sequences on shuffled pages; each sequence's prefix is already cached."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    perm = torch.randperm(shape.num_pages, generator=g).tolist()
    tables, slots = [], []
    for s, n in zip(seq_lens, query_lens):
        pages = [perm.pop() for _ in range(-(-s // shape.page_size))]
        tables.append(pages)
        slots += [pages[p // shape.page_size] * shape.page_size + p % shape.page_size for p in range(s - n, s)]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    meta = AttentionMetadata(list(query_lens), list(seq_lens), torch.tensor(slots, device=device), bt,
                             causal, window)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, shape.head_dim, generator=g).to(device=device, dtype=shape.dtype)
               for h in (shape.hq, shape.hkv, shape.hkv))
    return meta, q, k, v


def compare(sdpa, tri, meta, q, k, v, pad_to: int | None = None, layer: int = 1, staged: bool = False) -> dict:
    """Run both backends on one batch; max abs errors of outputs and caches, and of padded rows.
    `staged`: the decode batch reaches Triton as the engine stages it (packed inputs, shared buffers)."""
    ref = sdpa.forward(layer, *_prepared(sdpa, meta, q, k, v))
    extra = (pad_to or q.shape[0]) - q.shape[0]
    g = torch.Generator(device="cpu").manual_seed(99)
    pad = [torch.randn(extra, *x.shape[1:], generator=g).to(x) for x in (q, k, v)]
    if staged:
        stage_decode(tri, meta, pad_to or q.shape[0])
    else:
        tri.prepare(meta, pad_to=pad_to)
    out = tri.forward(layer, *(torch.cat([x, p]) for x, p in zip((q, k, v), pad)))
    n = q.shape[0]
    return {
        "out": (out[:n].float() - ref.float()).abs().max().item(),
        "ref_scale": ref.float().abs().max().item(),
        "pad_rows": out[n:].float().abs().max().item() if extra else 0.0,
        "k_cache": (tri.k_cache.float() - sdpa.k_cache.float()).abs().max().item(),
        "v_cache": (tri.v_cache.float() - sdpa.v_cache.float()).abs().max().item(),
    }


def stage_decode(tri, meta, rows: int) -> None:
    """Describe decode batch `meta` to `tri` through the engine's packed decode inputs: sequences with
    its block-table rows as pages, staged padded to `rows` in a buffer `tri` shares (made at the first
    call), then `prepare_staged_decode`."""
    from mstar.engines.autoregressive.decode_inputs import DecodeInputs
    from mstar.engines.autoregressive.sequence import Sequence
    from mstar.engines.sampling import SamplingParams

    dec = getattr(tri, "_test_decode_inputs", None)
    if dec is None:
        dec = tri._test_decode_inputs = DecodeInputs(tri.max_num_seqs, tri.max_pages_per_seq, tri.page_size,
                                                     tri.device)
        tri.share_decode_buffers(dec.seq_lens, dec.slots, dec.tables)
    seqs = []
    for i, length in enumerate(meta.seq_lens):
        seq = Sequence((f"s{i}", "main"), SamplingParams(), [0] * length, length)
        seq.pages = meta.block_tables[i, : -(-length // tri.page_size)].tolist()
        seqs.append(seq)
    host = dec.stage(seqs, [n - 1 for n in meta.seq_lens], True, rows, whole=True)
    dec.sent(host)
    tri.prepare_staged_decode(len(seqs), rows)


def _prepared(sdpa, meta, q, k, v):
    sdpa.prepare(meta)
    return q, k, v


def run_case(shape: Shape, seq_lens, query_lens, device: str = "cpu", causal: bool = True,
             window: int | None = None, pad_to: int | None = None, num_sms: int | None = None,
             warmup: tuple | None = None, max_num_seqs: int = 16, staged: bool = False) -> dict:
    """One comparison; `warmup` = (seq_lens, query_lens) of a batch run first on the same backends;
    `staged`: the decode batch is staged as the engine does (see `compare`); its warm-up batch then runs
    twice, so that both pinned host sets hold rows past the batch's own."""
    sdpa, tri = make_pair(shape, device, num_sms=num_sms, max_num_seqs=max_num_seqs)
    for _ in range(0 if warmup is None else 2 if staged else 1):
        compare(sdpa, tri, *random_batch(shape, *warmup, device, seed=7), staged=staged)
    return compare(sdpa, tri, *random_batch(shape, seq_lens, query_lens, device, causal=causal, window=window),
                   pad_to=pad_to, staged=staged)


GQA = Shape(hq=4, hkv=1)
MHA = Shape(hq=2, hkv=2, head_dim=24)  # 1:1 and a head size that is not a power of two
GQA3 = Shape(hq=6, hkv=2)  # groups of 3, like 24 query heads over 8 KV heads
# name -> kwargs of run_case (CPU interpreter sizes: tiny)
CPU_CASES = {
    "mixed_gqa4_causal": dict(shape=GQA, seq_lens=[9, 1, 13, 6, 70], query_lens=[9, 1, 1, 3, 67]),
    "mixed_mha_causal": dict(shape=MHA, seq_lens=[9, 1, 13, 30], query_lens=[9, 1, 1, 20]),
    "non_causal": dict(shape=GQA3, seq_lens=[7, 12, 30], query_lens=[7, 5, 20], causal=False),
    "sliding_window": dict(shape=GQA, seq_lens=[11, 10, 40], query_lens=[4, 1, 30], window=7),
    "decode_one_split": dict(shape=GQA3, seq_lens=[1, 5, 37, 130], query_lens=[1] * 4, num_sms=1),
    "decode_splits": dict(shape=GQA, seq_lens=[1, 5, 37, 230], query_lens=[1] * 4, num_sms=64),
    "decode_window_splits": dict(shape=MHA, seq_lens=[3, 200], query_lens=[1, 1], window=70, num_sms=64),
    "decode_padded": dict(shape=GQA, seq_lens=[17, 3, 66], query_lens=[1, 1, 1], pad_to=6, num_sms=64,
                          warmup=([40, 50, 60, 70], [1] * 4)),
    "decode_padded_one_split": dict(shape=GQA3, seq_lens=[9, 1], query_lens=[1, 1], pad_to=4, num_sms=1),
    # staged by the engine's packed inputs: a wider batch first, so that stale rows lie past the new ones
    "decode_staged": dict(shape=GQA, seq_lens=[17, 3, 66], query_lens=[1, 1, 1], pad_to=6, num_sms=64,
                          warmup=([40, 50, 60, 70, 9], [1] * 5), staged=True),
    "mixed_fp16": dict(shape=Shape(hq=4, hkv=1, dtype=torch.float16), seq_lens=[20, 33, 5],
                       query_lens=[20, 1, 2]),
}


def engine_case() -> dict:
    """Greedy tokens of the tiny engine model (tests/unit/test_ar_engine.py) through attention backend
    'triton' (chunked prefill, mixed batches, decode) and of its dense reference."""
    from mstar.engines.autoregressive import AutoregressiveEngine
    from mstar.engines.kv_cache.config import KVCacheConfig
    from tests.unit import test_ar_engine as ar

    model, ps = ar.TinyLM(), ar.prompts(8)[2:5]  # 4, 7 and 12 tokens
    config = KVCacheConfig(max_num_pages=64, page_size=4, attention_backend="triton")
    engine = AutoregressiveEngine(model, config, "cpu", max_batch_tokens=8,
                                  default_sampling=ar.SamplingParams(temperature=0.0))
    out = ar.drive(engine, [ar.item(f"r{i}", p, max_tokens=3) for i, p in enumerate(ps)])
    got = [ar.tokens_of(out[(f"r{i}", "main")]) for i in range(len(ps))]
    return {"got": got, "want": [ar.reference(model, p, 3) for p in ps]}


def engine_graphed_case() -> dict:
    """`engine_case` with decode graphs (CPU stand-ins that replay the whole padded bucket, captured by
    the runner, so the Triton backend reads the packed decode inputs) and lookahead on: greedy tokens,
    the reference's, and how many decode steps the graphs ran."""
    from mstar.engines.autoregressive import AutoregressiveEngine
    from mstar.engines.autoregressive import runner as runner_module
    from mstar.engines.kv_cache.config import KVCacheConfig
    from tests.unit import test_ar_engine as ar
    from tests.unit.graph_standins import EagerBatchGraphs

    model, ps = ar.TinyLM(), ar.prompts(8)[2:5]  # 4, 7 and 12 tokens
    config = KVCacheConfig(max_num_pages=64, page_size=4, attention_backend="triton")
    engine = AutoregressiveEngine(model, config, "cpu", max_batch_tokens=8, max_num_seqs=4, lookahead=True,
                                  default_sampling=ar.SamplingParams(temperature=0.0))
    runner_module.BatchGraphs = EagerBatchGraphs
    with torch.inference_mode():
        engine.runner.graphs = engine.runner._capture([1, 2, 4])
    out = ar.drive(engine, [ar.item(f"r{i}", p, max_tokens=6) for i, p in enumerate(ps)], loop=True)
    got = [ar.tokens_of(out[(f"r{i}", "main")]) for i in range(len(ps))]
    return {"got": got, "want": [ar.reference(model, p, 6) for p in ps], "replays": engine.runner.graphs.calls,
            "shared": engine.runner._shared_attn is not None, "lookahead_steps": engine.lookahead_steps}


def engine_prefill_graphed_case() -> dict:
    """`engine_graphed_case` with prefill graphs too (token buckets 5 and 8; CPU stand-ins that run the
    whole padded bucket, so the backend's graphed-prefill description is what the kernels read): the
    chunked prefills and mixed steps replay them, decode steps the decode graphs."""
    from mstar.engines.autoregressive import AutoregressiveEngine
    from mstar.engines.autoregressive import prefill_graph as prefill_module
    from mstar.engines.autoregressive import runner as runner_module
    from mstar.engines.kv_cache.config import KVCacheConfig
    from tests.unit import test_ar_engine as ar
    from tests.unit.graph_standins import EagerBatchGraphs

    model, ps = ar.TinyLM(), ar.prompts(8)[2:5]  # 4, 7 and 12 tokens
    config = KVCacheConfig(max_num_pages=64, page_size=4, attention_backend="triton")
    engine = AutoregressiveEngine(model, config, "cpu", max_batch_tokens=8, max_num_seqs=4, lookahead=True,
                                  default_sampling=ar.SamplingParams(temperature=0.0))
    runner_module.BatchGraphs = prefill_module.BatchGraphs = EagerBatchGraphs
    with torch.inference_mode():
        engine.runner.graphs = engine.runner._capture([1, 2, 4])
        engine.runner.prefill_graphs = engine.runner._capture_prefill(engine.runner.attn, [5, 8])
    eager_steps = []
    forward = engine.runner._eager
    engine.runner._eager = lambda *a: eager_steps.append(a[0].shape[0]) or forward(*a)
    out = ar.drive(engine, [ar.item(f"r{i}", p, max_tokens=6) for i, p in enumerate(ps)])
    got = [ar.tokens_of(out[(f"r{i}", "main")]) for i in range(len(ps))]
    from mstar.engines.attention.base import AttentionMetadata

    prefill = engine.runner.prefill_graphs  # what a capture runs: the dummy batch of a bucket, then the forward
    prefill._describe_dummy_batch(8)
    with torch.inference_mode():
        dummy = prefill._forward(torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long))
    dummy_ok = bool(torch.isfinite(dummy).all()) and engine.runner.attn.num_rows == 4
    too_many = AttentionMetadata([6], [6], torch.full((6,), -1, dtype=torch.long), torch.zeros(1, 2, dtype=torch.int32))
    try:  # 6 tokens do not fit a bucket of 5
        engine.runner.attn.prepare_graphed_prefill(too_many, 5)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"got": got, "want": [ar.reference(model, p, 6) for p in ps],
            "prefill_replays": engine.runner.prefill_graphs.replays, "eager_steps": eager_steps,
            "decode_replays": engine.runner.graphs.calls, "refused": refused, "dummy_ok": dummy_ok}


ENGINE_CASES = {"engine_greedy": engine_case, "engine_graphed": engine_graphed_case,
                "engine_prefill_graphed": engine_prefill_graphed_case}


def _fix_interpreter_scalars() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and calls int() on them for loop
    bounds, which numpy >= 2.4 refuses; read the element instead (test harness only)."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def main() -> None:
    """Run CPU_CASES (under TRITON_INTERPRET=1) and print {name: errors or {'error': traceback}} as JSON."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    _fix_interpreter_scalars()
    torch.manual_seed(0)
    names = sys.argv[1:] or list(CPU_CASES)
    results = {}
    for name in names:
        try:
            results[name] = ENGINE_CASES[name]() if name in ENGINE_CASES else run_case(**CPU_CASES[name])
        except Exception:  # report every case, not just the first failure
            results[name] = {"error": traceback.format_exc()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
