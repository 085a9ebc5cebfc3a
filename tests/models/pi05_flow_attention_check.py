"""Checks of Pi0.5's flow attention over the valid keys only (`mstar/models/pi05/flow_attention.py`) against the
masked form (SDPA over the padded prefix and the actions' keys, the padding masked); run with TRITON_INTERPRET=1
(by test_pi05_flow_attention.py, in a fresh process).

Kernel alone: robots of different prefix lengths in one batch (one of them empty, as a graph's padded row is;
one filling the padded width), one split and several (empty splits too), one and two KV heads, strided inputs
as the expert hands them, float16 (the interpreter's bf16 dot is wrong). Whole policy: the tiny policy's chunks for a batch of robots, kernel against
masked form (`fused_kernels(False)`).

    TRITON_INTERPRET=1 python3 tests/models/pi05_flow_attention_check.py [--quick]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from mstar.layers.fused import fused_kernels
from mstar.models.pi05.flow_attention import default_splits, valid_keys_attention
from mstar.models.pi05.gemma import attention_bias
from tests.unit.paged_attention_cases import _fix_interpreter_scalars

TOL = dict(atol=2e-5, rtol=2e-5)


def masked(q, prefix_k, prefix_v, prefix_len, k, v) -> torch.Tensor:
    """The same attention as SDPA over all keys, the padding masked: 8-head GQA spelled out."""
    batch, chunk, heads, dim = q.shape
    padded = prefix_k.shape[1]
    keys, values = torch.cat([prefix_k, k], 1).transpose(1, 2), torch.cat([prefix_v, v], 1).transpose(1, 2)
    positions = torch.arange(padded + chunk)[None, :]
    valid = (positions < prefix_len[:, None]) | (positions >= padded)
    groups = heads // k.shape[2]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    bias = attention_bias(valid, q.dtype)[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2).float(), keys.float(), values.float(), attn_mask=bias.float())
    return out.transpose(1, 2).to(q.dtype)


def _case(lengths: list[int], padded: int, chunk: int, heads: int, kv: int, dim: int, splits: int | None,
          dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    qkv = torch.randn(batch, chunk, heads + 2 * kv, dim, generator=gen).to(dtype)  # strided views, as `project`
    q, k, v = qkv.split([heads, kv, kv], dim=2)
    prefix_k, prefix_v = (torch.randn(2, batch, padded, kv, dim, generator=gen).to(dtype) * 2).unbind(0)
    prefix_len = torch.tensor([[n, -1] for n in lengths])[:, 0]  # strided, as a page table's column
    got = valid_keys_attention(q, prefix_k, prefix_v, prefix_len, k, v, splits)
    want = masked(q, prefix_k, prefix_v, prefix_len, k, v)
    tol = TOL if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{lengths} splits {splits} {dtype}: {m}")
    prefix_k[0, lengths[0]:] = float("nan")  # the padding is never read
    prefix_v[0, lengths[0]:] = float("nan")
    torch.testing.assert_close(valid_keys_attention(q, prefix_k, prefix_v, prefix_len, k, v, splits), got, atol=0,
                               rtol=0)


def check_kernel(quick: bool) -> None:
    _case([40, 0, 96, 7], padded=96, chunk=10, heads=4, kv=1, dim=16, splits=None)
    if quick:
        return
    for splits in (1, 2, 5, 16):  # 16 splits of 4 keys' blocks: most of them empty
        _case([40, 0, 96, 7], padded=96, chunk=10, heads=4, kv=1, dim=16, splits=splits, seed=splits)
    _case([33, 80], padded=80, chunk=50, heads=8, kv=1, dim=32, splits=3, seed=7)  # rows past the last block
    _case([5, 64, 20], padded=64, chunk=12, heads=4, kv=2, dim=16, splits=2, seed=8)
    _case([50, 17], padded=64, chunk=10, heads=2, kv=1, dim=24, splits=1, seed=9)  # head_dim not a power of 2
    _case([70, 12], padded=96, chunk=20, heads=4, kv=1, dim=16, splits=3, dtype=torch.float16, seed=10)
    q = torch.empty(1, 50, 8, 256)
    # 13 programs a robot on 132 SMs: 11 splits for one robot, 2 for eight, 1 once programs outnumber the SMs
    assert [default_splits(q.expand(b, -1, -1, -1), 976, 50, 1) for b in (1, 8, 11, 16)] == [11, 2, 1, 1]


def check_policy() -> None:
    """The tiny policy's chunks for robots of different prompts and camera counts: kernel and masked form."""
    from mstar.models.pi05 import gemma
    from mstar.models.pi05.network import PolicyNet
    from mstar.models.pi05.weights import build
    from tests.models.test_pi05_fast_path import CONFIG, ROBOTS, _chunks, _policy, _robot

    net = build(lambda: PolicyNet(CONFIG), torch.float32, "cpu", None, None, seed=4, std=0.1).eval()
    robots = {rid: _robot(*spec) for rid, spec in ROBOTS.items()}
    got = _chunks(_policy(net), robots)
    with fused_kernels(False):
        want = _chunks(_policy(net), robots)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert not torch.allclose(got[0], got[1], atol=1e-3)
    assert gemma._FLOW_ATTENTION.usable, "the kernel failed: both chunks came from the masked form"


def main() -> None:
    _fix_interpreter_scalars()
    torch.set_num_threads(1)
    quick = "--quick" in sys.argv[1:]
    check_kernel(quick)
    check_policy()
    print("flow attention ok")


if __name__ == "__main__":
    main()
