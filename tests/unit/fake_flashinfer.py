"""A CPU stand-in for the `flashinfer` package: its two paged-KV wrappers in plain torch.

It follows FlashInfer's DOCUMENTED semantics (docs.flashinfer.ai, flashinfer/decode.py and prefill.py
of flashinfer-python 0.7.4): row i's pages are `indices[indptr[i]:indptr[i + 1]]`, the last one
holding `last_page_len[i]` (1..page_size) tokens; "NHD" caches given as a (k, v) tuple of
[pages, page_size, Hkv, D]; the causal mask is aligned bottom-right (new tokens are a sequence's
last ones); `window_left` keeps keys j >= i - window_left; in CUDA-graph mode the batch size is fixed
by the buffers given at construction, `plan()` copies into them and `run()` reads them.

So tests built on it check OUR adapter (metadata conversion, call sequence, graph-mode buffer use),
not FlashInfer: agreement here says nothing about FlashInfer's kernels. Install it with
`monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)`; `CALLS` logs every call.
"""

from __future__ import annotations

import torch

CALLS: list[tuple] = []  # (what, wrapper kind, batch size or layer detail)


def _check_index(indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, page_size: int) -> int:
    """Validate a CSR page description as FlashInfer documents it; returns the batch size."""
    for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last)):
        assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    batch = last.shape[0]
    assert indptr.shape == (batch + 1,), f"indptr {tuple(indptr.shape)} for batch {batch}"
    ip = indptr.tolist()
    assert ip[0] == 0 and all(a <= b for a, b in zip(ip, ip[1:])), f"indptr not a prefix sum: {ip}"
    assert indices.shape[0] >= ip[-1], f"{indices.shape[0]} indices < indptr[-1]={ip[-1]}"
    assert all(b > a for a, b in zip(ip, ip[1:])), f"a row without pages: indptr={ip}"
    assert all(1 <= n <= page_size for n in last.tolist()), f"last_page_len out of [1, {page_size}]: {last}"
    return batch


class _Wrapper:
    """What both wrappers share: the workspace, the layout, and the attention math of `run`."""

    kind = ""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert float_workspace_buffer.dtype == torch.uint8, "the workspace is a uint8 buffer"
        assert kv_layout == "NHD", f"the adapter stores NHD caches, got {kv_layout}"
        self._plan: dict | None = None

    def _store_plan(self, qo_indptr: torch.Tensor, heads: tuple[int, int, int, int], q_dtype, kv_dtype, **opts):
        num_qo, num_kv, head_dim, page_size = heads
        assert num_qo % num_kv == 0, f"{num_qo} query heads over {num_kv} KV heads"
        self._plan = dict(qo_indptr=qo_indptr.clone(), num_qo=num_qo, num_kv=num_kv, head_dim=head_dim,
                          page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype or q_dtype, **opts)

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        p = self._plan
        assert p is not None, "run() before plan()"
        k_cache, v_cache = paged_kv_cache
        assert q.is_contiguous() and q.dtype == p["q_dtype"], f"q {q.dtype} (planned {p['q_dtype']})"
        assert k_cache.dtype == v_cache.dtype == p["kv_dtype"]
        assert k_cache.shape[1:] == (p["page_size"], p["num_kv"], p["head_dim"]), tuple(k_cache.shape)
        assert q.shape[1:] == (p["num_qo"], p["head_dim"]) and q.shape[0] == int(p["qo_indptr"][-1])
        indptr, indices, last = self._index()  # graph mode: read the fixed buffers now, as a replay does
        _check_index(indptr, indices, last, p["page_size"])
        assert int(indices[: int(indptr[-1])].max()) < k_cache.shape[0], "page id past the cache"
        CALLS.append(("run", self.kind, last.shape[0]))
        out = torch.empty(q.shape, dtype=p["q_dtype"])
        qo = p["qo_indptr"].tolist()
        for b in range(last.shape[0]):
            pages = indices[int(indptr[b]) : int(indptr[b + 1])].long()
            kv_len = (pages.numel() - 1) * p["page_size"] + int(last[b])
            keys = k_cache[pages].reshape(-1, p["num_kv"], p["head_dim"])[:kv_len].float()
            values = v_cache[pages].reshape(-1, p["num_kv"], p["head_dim"])[:kv_len].float()
            out[qo[b] : qo[b + 1]] = _attend(q[qo[b] : qo[b + 1]].float(), keys, values, p).to(out.dtype)
        return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, p: dict) -> torch.Tensor:
    """[n, Hq, D] queries, the last n positions of a sequence of len(keys) tokens, over its keys."""
    n, kv_len, group = q.shape[0], keys.shape[0], p["num_qo"] // p["num_kv"]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scale = p["sm_scale"] if p["sm_scale"] is not None else p["head_dim"] ** -0.5
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    q_pos = torch.arange(kv_len - n, kv_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    allowed = torch.ones(n, kv_len, dtype=torch.bool)
    if p["causal"]:
        allowed &= k_pos <= q_pos
    if p["window_left"] >= 0:
        allowed &= k_pos >= q_pos - p["window_left"]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    """One query token per row over its pages; graph mode: fixed batch, fixed index buffers."""

    kind = "decode"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None, backend: str = "auto") -> None:
        super().__init__(float_workspace_buffer, kv_layout)
        self.use_cuda_graph, self.use_tensor_cores = use_cuda_graph, use_tensor_cores
        self.fixed_batch = 0
        if use_cuda_graph:
            assert all(torch.is_tensor(t) for t in (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                                                    paged_kv_last_page_len_buffer)), "graph mode needs buffers"
            self.fixed_batch = len(paged_kv_last_page_len_buffer)
            assert len(paged_kv_indptr_buffer) == self.fixed_batch + 1
        self._bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        CALLS.append(("init", self.kind, self.fixed_batch if use_cuda_graph else None))

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *, pos_encoding_mode: str = "NONE",
             window_left: int = -1, q_data_type=torch.float16, kv_data_type=None, sm_scale=None) -> None:
        assert pos_encoding_mode == "NONE", "the adapter applies RoPE itself"
        batch = _check_index(indptr, indices, last_page_len, page_size)
        if self.use_cuda_graph:
            if batch != self.fixed_batch:
                raise ValueError(f"batch {batch} != fixed batch {self.fixed_batch} in cuda graph mode")
            if len(indices) > len(self._bufs[1]):
                raise ValueError("indices exceed the indices buffer")
            self._bufs[0].copy_(indptr)
            self._bufs[2].copy_(last_page_len)
            self._bufs[1][: len(indices)].copy_(indices)
        else:
            self._bufs = (indptr.clone(), indices.clone(), last_page_len.clone())
        self._store_plan(torch.arange(batch + 1, dtype=torch.int32), (num_qo_heads, num_kv_heads, head_dim, page_size),
                         q_data_type, kv_data_type, causal=True, window_left=window_left, sm_scale=sm_scale)
        CALLS.append(("plan", self.kind, batch))

    def _index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._bufs  # type: ignore[return-value]


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    """Ragged queries (qo_indptr) over paged keys; graph mode is not modelled (the adapter never uses it)."""

    kind = "prefill"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 **buffers) -> None:
        super().__init__(float_workspace_buffer, kv_layout)
        assert not use_cuda_graph and not buffers, "the adapter runs prefill eagerly"
        self._bufs: tuple | None = None
        CALLS.append(("init", self.kind, None))

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, *, causal: bool = False, window_left: int = -1, sm_scale=None,
             q_data_type=torch.float16, kv_data_type=None, pos_encoding_mode: str = "NONE") -> None:
        assert qo_indptr.dtype == torch.int32 and pos_encoding_mode == "NONE"
        batch = _check_index(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        qo = qo_indptr.tolist()
        assert len(qo) == batch + 1 and qo[0] == 0 and all(b > a for a, b in zip(qo, qo[1:])), qo
        ip, last = paged_kv_indptr.tolist(), paged_kv_last_page_len.tolist()
        for b in range(batch):  # FlashInfer's causal alignment needs kv_len >= qo_len
            assert (ip[b + 1] - ip[b] - 1) * page_size + last[b] >= qo[b + 1] - qo[b], "query past its keys"
        self._bufs = (paged_kv_indptr.clone(), paged_kv_indices.clone(), paged_kv_last_page_len.clone())
        self._store_plan(qo_indptr, (num_qo_heads, num_kv_heads, head_dim_qk, page_size), q_data_type,
                         kv_data_type, causal=causal, window_left=window_left, sm_scale=sm_scale)
        CALLS.append(("plan", self.kind, batch))

    def _index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self._bufs is not None
        return self._bufs
