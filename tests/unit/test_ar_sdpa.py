"""SDPA paged attention backend against dense torch attention on random data."""

import torch
import torch.nn.functional as F

from mstar.engines.attention.base import AttentionMetadata
from mstar.engines.attention.sdpa import SDPABackend
from mstar.engines.base import KVLayout

PAGE = 4
HQ, HKV, D = 4, 2, 8


def _setup(seq_lens, query_lens, causal=True, window=None, seed=0):
    """A backend with random pages; returns (backend, meta, full q/k/v per sequence)."""
    g = torch.Generator().manual_seed(seed)
    backend = SDPABackend(KVLayout(1, HKV, D, torch.float64), num_pages=32, page_size=PAGE, device="cpu")
    perm = torch.randperm(32, generator=g).tolist()  # scattered, non-contiguous pages
    tables, slots, full = [], [], []
    for s, q in zip(seq_lens, query_lens):
        pages = [perm.pop() for _ in range(-(-s // PAGE))]
        tables.append(pages)
        qkv = [torch.randn(s, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV)]
        full.append(qkv)
        # the cached prefix is already in the pool; only the q new tokens go through forward
        for pos in range(s):
            slot = pages[pos // PAGE] * PAGE + pos % PAGE
            if pos < s - q:
                backend.k_cache[0].view(-1, HKV, D)[slot] = qkv[1][pos]
                backend.v_cache[0].view(-1, HKV, D)[slot] = qkv[2][pos]
            else:
                slots.append(slot)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(list(query_lens), list(seq_lens), torch.tensor(slots), bt, causal, window)
    backend.prepare(meta)
    return backend, full


def _dense(q, k, v, num_new, causal, window=None):
    s = k.shape[0]
    qpos = torch.arange(s - num_new, s)[:, None]
    kpos = torch.arange(s)[None, :]
    mask = torch.ones(num_new, s, dtype=torch.bool)
    if causal:
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
    rep = HQ // HKV
    out = F.scaled_dot_product_attention(q[-num_new:].transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                         v.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


def _check(seq_lens, query_lens, causal=True, window=None):
    backend, full = _setup(seq_lens, query_lens, causal, window)
    new = [[t[-q:] for t in qkv] for qkv, q in zip(full, query_lens)]
    q, k, v = (torch.cat([n[i] for n in new]) for i in range(3))
    out = backend.forward(0, q, k, v)
    expected = torch.cat([_dense(*qkv, n, causal, window) for qkv, n in zip(full, query_lens)])
    torch.testing.assert_close(out, expected)
    # the new tokens' k/v were written into the pages
    layer_k = backend.k_cache[0].view(-1, HKV, D)
    torch.testing.assert_close(layer_k[backend._batch.slot_mapping], k)


def test_causal_mixed_prefill_and_decode_with_gqa():
    _check(seq_lens=[9, 1, 13, 6], query_lens=[9, 1, 1, 3])


def test_non_causal_new_tokens_see_each_other():
    _check(seq_lens=[7, 12], query_lens=[7, 5], causal=False)


def test_sliding_window():
    _check(seq_lens=[11, 10], query_lens=[4, 1], window=3)
