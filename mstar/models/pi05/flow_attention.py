"""The action expert's attention over the valid keys only, a Triton kernel.

Each robot's action queries attend its own prefix's first `prefix_len` keys and the chunk's action keys,
and never read the padding past its prefix (the flow's prefixes are padded to the page table's width, so
in a batch each has its own length).

One program handles (block of query rows, robot and KV head, split of the keys). The query heads of a KV
head are rows of one attention (row r: action r // GROUP, head r % GROUP of the group), so each key is read
once per group. A robot's keys are numbered 0 .. prefix_len + chunk: the prefix's first, then the
actions'; a block that straddles the two loads each key from where it lives. The keys are cut into
`splits` even ranges (whole blocks), so that one robot's 50 actions still fill the GPU: each split writes
its normalised partial output and log-sum-exp, and a second kernel merges them (with one split the first
kernel writes the output). Lengths are read on the device: one launch, and one captured CUDA graph, serves
any prefix lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels.decode_attention import attend_block

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
INTERPRETER_SMS = 132  # the interpreter has no device: split as a large GPU would


@triton.jit
def _keys(prefix_ptr, action_ptr, b, kvh, n, length, hi, d, dmask, spb, spn, sph, sab, san, sah):
    """Keys (or values) [BLOCK_N, BLOCK_D] at positions n of a robot's keys: the prefix's below `length`,
    the actions' from there to `hi` (zero past it), and the mask of the positions that hold one."""
    from_prefix = n < length
    from_actions = (n >= length) & (n < hi)
    prefix = tl.load(prefix_ptr + b * spb + n[:, None].to(tl.int64) * spn + kvh * sph + d[None, :],
                     mask=from_prefix[:, None] & dmask[None, :], other=0.0)
    actions = tl.load(action_ptr + b * sab + (n - length)[:, None].to(tl.int64) * san + kvh * sah + d[None, :],
                      mask=from_actions[:, None] & dmask[None, :], other=0.0)
    return tl.where(from_prefix[:, None], prefix.to(actions.dtype), actions), from_prefix | from_actions


@triton.jit
def _flow_kernel(q_ptr, pk_ptr, pv_ptr, k_ptr, v_ptr, len_ptr, out_ptr, part_ptr, lse_ptr,
                 sqb, sql, sqh, spkb, spkn, spkh, spvb, spvn, spvh, skb, skn, skh, svb, svn, svh, sob, sol, soh,
                 stride_len, rows, chunk, qk_scale,
                 NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    mb = tl.program_id(0)
    bh = tl.program_id(1)
    split = tl.program_id(2)
    b = bh // NUM_KV_HEADS
    kvh = bh % NUM_KV_HEADS
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < rows
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    row_mask = rmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + (b * sqb + (r // GROUP) * sql + (kvh * GROUP + r % GROUP) * sqh)[:, None] + d[None, :],
                mask=row_mask, other=0.0)

    length = tl.load(len_ptr + b * stride_len)
    total = length + chunk
    per_split = ((total + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, total)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):  # position `start` always holds a key: no row sees an empty block
        n = start + tl.arange(0, BLOCK_N)
        k, seen = _keys(pk_ptr, k_ptr, b, kvh, n, length, hi, d, dmask, spkb, spkn, spkh, skb, skn, skh)
        v, _ = _keys(pv_ptr, v_ptr, b, kvh, n, length, hi, d, dmask, spvb, spvn, spvh, svb, svn, svh)
        m_i, l_i, acc = attend_block(q, k, v, seen, m_i, l_i, acc, qk_scale, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split (lo >= hi) leaves zeros
    if NUM_SPLITS == 1:
        dst = out_ptr + (b * sob + (r // GROUP) * sol + (kvh * GROUP + r % GROUP) * soh)[:, None] + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        part = (split * tl.num_programs(1) + bh) * rows + r
        tl.store(part_ptr + part[:, None].to(tl.int64) * HEAD_DIM + d[None, :], out, mask=row_mask)
        tl.store(lse_ptr + part, tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf")), mask=rmask)


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, out_ptr, sob, sol, soh, rows,
                  NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    mb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // NUM_KV_HEADS
    kvh = bh % NUM_KV_HEADS
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < rows
    d = tl.arange(0, BLOCK_D)
    row_mask = rmask[:, None] & (d < HEAD_DIM)[None, :]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(lse_ptr + (split * tl.num_programs(1) + bh) * rows + r, mask=rmask,
                                  other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)  # rows past the last: no split holds them
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        part = (split * tl.num_programs(1) + bh) * rows + r
        weight = tl.exp2(tl.load(lse_ptr + part, mask=rmask, other=float("-inf")) - m)
        total += weight
        acc += weight[:, None] * tl.load(part_ptr + part[:, None].to(tl.int64) * HEAD_DIM + d[None, :],
                                         mask=row_mask, other=0.0)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    dst = out_ptr + (b * sob + (r // GROUP) * sol + (kvh * GROUP + r % GROUP) * soh)[:, None] + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def blocks(head_dim: int) -> tuple[int, int]:
    """(BLOCK_M query rows, BLOCK_N keys) of a program at this head size: smaller tiles for wide heads, whose
    float32 accumulator takes BLOCK_M x head_dim registers."""
    return (32, 32) if head_dim > 128 else (64, 64)


def default_splits(q: torch.Tensor, prefix_keys: int, chunk: int, num_kv_heads: int) -> int:
    """Key splits that give at least one program per SM (with fewer, a program walks a robot's keys alone while
    SMs idle), each split at least two key blocks long."""
    block_m, block_n = blocks(q.shape[-1])
    programs = triton.cdiv(q.shape[1] * q.shape[2], block_m) * q.shape[0]
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else INTERPRETER_SMS
    return max(1, min(MAX_SPLITS, triton.cdiv(sms, programs), triton.cdiv(prefix_keys + chunk, 2 * block_n)))


def valid_keys_attention(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, prefix_len: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """softmax(q keys^T / sqrt(D)) values for the action queries q [B, C, H, D], where robot b's keys and values
    are its prefix's first prefix_len[b] rows of prefix_k / prefix_v [B, P, KV, D], then the actions' own k / v
    [B, C, KV, D] -> [B, C, H, D] in q's dtype. Only the last dimension of each input need be contiguous
    (`prefix_len` may be strided: a page table's column).
    `splits` (default `default_splits`) cuts each robot's keys into that many ranges. Launch only: no host sync.
    """
    batch, chunk, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    assert num_heads % num_kv_heads == 0 and prefix_k.shape[2:] == k.shape[2:] == (num_kv_heads, head_dim), (
        q.shape, prefix_k.shape, k.shape)
    assert prefix_len.shape == (batch,) and prefix_v.shape == prefix_k.shape and v.shape == k.shape
    q, prefix_k, prefix_v, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, prefix_k, prefix_v, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rows, group = chunk * (num_heads // num_kv_heads), num_heads // num_kv_heads
    splits = splits or default_splits(q, prefix_k.shape[1], chunk, num_kv_heads)
    block_m, block_n = blocks(head_dim)
    block_d = triton.next_power_of_2(head_dim)
    grid = (triton.cdiv(rows, block_m), batch * num_kv_heads, splits)
    part = lse = out  # unused with one split
    if splits > 1:
        part = torch.empty(splits, batch * num_kv_heads, rows, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, batch * num_kv_heads, rows, dtype=torch.float32, device=q.device)
    constants = dict(NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=splits)
    _flow_kernel[grid](
        q, prefix_k, prefix_v, k, v, prefix_len, out, part, lse, *q.stride()[:3], *prefix_k.stride()[:3],
        *prefix_v.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], prefix_len.stride(0), rows, chunk,
        head_dim ** -0.5 * LOG2E, **constants, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)
    if splits > 1:
        merge_m = 16
        _merge_kernel[(triton.cdiv(rows, merge_m), batch * num_kv_heads)](
            part, lse, out, *out.stride()[:3], rows, **constants, BLOCK_M=merge_m, BLOCK_D=block_d, num_warps=4)
    return out
