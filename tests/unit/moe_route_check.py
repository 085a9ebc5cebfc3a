"""Checks of kernels/moe_route.route_topk against the PyTorch route; run with TRITON_INTERPRET=1 (by
test_moe_route.py, in a fresh process so the interpreter setting holds for the kernel)."""

from __future__ import annotations

import torch

from mstar.kernels.moe_route import route_topk
from mstar.layers.fused import fused_kernels
from mstar.layers.moe import route


def reference_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    with fused_kernels(False):  # route's PyTorch form (with the fused kernels on it calls route_topk)
        return route(logits, top_k, renormalize)


def check(tokens: int, experts: int, top_k: int, renormalize: bool, dtype: torch.dtype) -> None:
    logits = (2 * torch.randn(tokens, experts)).to(dtype)
    weights, ids = route_topk(logits, top_k, renormalize)
    want_w, want_ids = reference_route(logits, top_k, renormalize)
    assert weights.dtype == want_w.dtype and ids.dtype == torch.long
    assert torch.equal(ids, want_ids), (tokens, experts, top_k, ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6 if dtype == torch.float32 else 1e-3, rtol=1e-3)


def check_ties() -> None:
    """Equal logits: the lower expert id first, as the reference's topk gives them on CPU."""
    logits = torch.zeros(2, 8)
    logits[1, 5] = 1.0
    _, ids = route_topk(logits, 3, True)
    assert ids.tolist() == [[0, 1, 2], [5, 0, 1]], ids


def check_rejects() -> None:
    for bad in (lambda: route_topk(torch.zeros(2, 2048), 2, True), lambda: route_topk(torch.zeros(2, 8), 9, True),
                lambda: route_topk(torch.zeros(8, 2).t(), 1, True)):
        try:
            bad()
        except ValueError:
            continue
        raise AssertionError("route_topk accepted a bad shape")


if __name__ == "__main__":
    torch.manual_seed(0)
    for dt in (torch.float32, torch.float16):
        for tokens, experts, k in ((1, 128, 8), (3, 128, 6), (5, 100, 1), (2, 8, 8)):
            for renorm in (True, False):
                check(tokens, experts, k, renorm, dt)
    check_ties()
    logits = torch.randn(3, 128)  # route itself takes the kernel where the fused kernels serve
    assert all(torch.equal(a, b) for a, b in zip(route(logits, 8, True), route_topk(logits, 8, True)))
    check_rejects()
    weights, ids = route_topk(torch.zeros(0, 16), 2, True)
    assert weights.shape == (0, 2) and ids.shape == (0, 2)
    print("moe route ok")
