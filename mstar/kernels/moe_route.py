"""The MoE router's softmax, top-k and renormalisation in one Triton launch (`mstar.layers.moe.route`).

In PyTorch the route is a float32 softmax, `topk`, a sum and a division and a cast: five or more
kernels per MoE layer, each a few microseconds at decode batch sizes, so for the 48 layers of the
Qwen3-Omni thinker they cost about as much as reading the experts. Here one program per token loads
its E router logits (E <= 1024), computes the softmax in float32, picks the k largest by k rounds of
argmax (ties go to the lower expert id), renormalises them (optional) and writes the weights in the
logits' dtype and the ids as int64, in descending order of weight as `torch.topk` gives them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 1024  # one program holds a token's router row in registers


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    inside = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=inside, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(inside, e / tl.sum(e, axis=0), -1.0)  # -1: below every probability, never picked
    ks = tl.arange(0, BLOCK_K)
    picked_p = tl.zeros((BLOCK_K,), tl.float32)
    picked_id = tl.zeros((BLOCK_K,), tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        best_id = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)  # the lowest id among ties
        picked_p = tl.where(ks == j, best, picked_p)
        picked_id = tl.where(ks == j, best_id.to(tl.int64), picked_id)
        p = tl.where(offs == best_id, -1.0, p)
    if RENORMALIZE:
        picked_p = picked_p / tl.sum(tl.where(ks < TOP_K, picked_p, 0.0), axis=0)
    keep = ks < TOP_K
    tl.store(weights_ptr + row * TOP_K + ks, picked_p.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + row * TOP_K + ks, picked_id, mask=keep)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (unit stride over E, E <= MAX_EXPERTS) -> (weights [T, k] in the logits'
    dtype, expert ids [T, k] int64), as `mstar.layers.moe.route` computes them."""
    tokens, experts = logits.shape
    if experts > MAX_EXPERTS or logits.stride(1) != 1 or not 0 < top_k <= experts:
        raise ValueError(f"route_topk takes [T, E <= {MAX_EXPERTS}] logits with unit stride and 0 < k <= E; got "
                         f"{tuple(logits.shape)} (strides {logits.stride()}), k={top_k}")
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.long, device=logits.device)
    if tokens:
        block_e = triton.next_power_of_2(experts)
        _route_kernel[(tokens,)](logits, weights, ids, experts, logits.stride(0), TOP_K=top_k, BLOCK_E=block_e,
                                 BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                                 num_warps=min(max(block_e // 256, 1), 8))
    return weights, ids
