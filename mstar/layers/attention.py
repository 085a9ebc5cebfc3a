"""The attention front-end of Llama-family decoders: projections, qk-norm, RoPE, backend call, output.

The KV cache and the attention kernel live in the backend (`mstar.engines.attention`); this module
only turns hidden states [T, hidden] into q/k/v [T, heads, head_dim] and back. A backend whose
`fuses_rotary` is true for the prepared batch takes q/k un-rotated through `forward_rotary(layer, q,
k, v, cos, sin)` and applies RoPE itself (the Triton decode kernel); others get rotated q/k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.kernels.guard import KernelGuard
from mstar.layers.fused import FUSED
from mstar.layers.linear import linear
from mstar.layers.norm import PendingNorm, RMSNorm
from mstar.layers.rope import apply_rotary

_QK_NORM_ROTARY = KernelGuard("qk_norm_rotary")


def normed_rotated_qk(qk: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_q: int, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
    """Qwen3's q and k: each row's q heads then k heads [T, Hq + Hk, D], each head RMS-normed (`q_norm`
    for the first `num_q`, `k_norm` for the rest) then rotated by cos/sin [T, D]. One launch where the
    fused kernels serve (`fused_ops.qk_norm_rotary`), else the layers; a new [T, Hq + Hk, D] tensor."""

    def unfused() -> torch.Tensor:
        return torch.cat([apply_rotary(q_norm(qk[:, :num_q]), cos, sin), apply_rotary(k_norm(qk[:, num_q:]), cos, sin)],
                         dim=1)

    ops = FUSED.ops_for(qk)
    if ops is None or cos.stride(1) != 1 or q_norm.eps != k_norm.eps:
        return unfused()
    return _QK_NORM_ROTARY.run(lambda: ops.qk_norm_rotary(qk, q_norm.weight, k_norm.weight, num_q, cos, sin, q_norm.eps),
                               unfused)


@dataclass(frozen=True)
class AttentionSpec:
    """Shape and options of one self-attention layer."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False  # Qwen2: bias on q/k/v only
    o_bias: bool = False  # Llama/Qwen3 `attention_bias`: bias on o_proj too
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of q and k before RoPE
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )


class SelfAttention(nn.Module):
    """Causal self-attention whose cache and kernel belong to the backend passed to `forward`."""

    def __init__(self, spec: AttentionSpec, layer_idx: int) -> None:
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.norm_eps)

    def forward(self, x: torch.Tensor | PendingNorm, cos: torch.Tensor, sin: torch.Tensor, attn: Any) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `attn` is an AttentionBackend already prepared for the batch.
        x may be a PendingNorm, which the qkv projection consumes."""
        t, d = x.shape[0], self.spec.head_dim
        qkv = linear(x, self.qkv_proj)
        ops = FUSED.ops_for(qkv)
        if ops is not None and qkv.is_contiguous() and cos.stride(1) == 1:
            heads = qkv.view(t, -1, d)
            num_q, num_kv = self.spec.num_heads, self.spec.num_kv_heads
            # q and k heads sit side by side in each qkv row: one launch norms (Qwen3) and rotates both.
            if self.spec.qk_norm:
                qk = normed_rotated_qk(heads[:, :num_q + num_kv], self.q_norm, self.k_norm, num_q, cos, sin)
            elif getattr(attn, "fuses_rotary", False):
                # The backend rotates q and k as its kernel loads them: no rotary launch, no round trip.
                q, k, v = heads.split([num_q, num_kv, num_kv], dim=1)
                out = attn.forward_rotary(self.layer_idx, q, k, v, cos, sin)
                return linear(out.reshape(t, self.q_size), self.o_proj)
            else:
                qk = ops.rotary(heads[:, :num_q + num_kv], cos, sin)
            q, k = qk.split([num_q, num_kv], dim=1)
            out = attn.forward(self.layer_idx, q, k, heads[:, num_q + num_kv:])
            return linear(out.reshape(t, self.q_size), self.o_proj)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.spec.num_heads, d)
        k = k.view(t, self.spec.num_kv_heads, d)
        v = v.view(t, self.spec.num_kv_heads, d)
        if self.spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn.forward(self.layer_idx, q, k, v)
        return linear(out.reshape(t, self.q_size), self.o_proj)
