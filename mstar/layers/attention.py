"""The attention front-end of Llama-family decoders: projections, qk-norm, RoPE, backend call, output.

The KV cache and the attention kernel live in the backend (`mstar.engines.attention`); this module
only turns hidden states [T, hidden] into q/k/v [T, heads, head_dim] and back.

Tensor parallelism over heads (`HeadShard`): each rank of a group holds an equal share of the q heads and
of the KV heads (its rows of the qkv projection, its columns of the output projection, its KV heads in
the cache), attends with them alone, and one all-reduce sums the output projections' shares.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from mstar.kernels.guard import KernelGuard
from mstar.layers.fused import FUSED
from mstar.layers.linear import linear
from mstar.layers.norm import RMSNorm
from mstar.layers.rope import apply_rotary

_QK_NORM_ROTARY = KernelGuard("qk_norm_rotary")


def normed_rotated_qk(qk: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_q: int, cos: torch.Tensor,
                      sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen3's q and k: each row's q heads then k heads [T, Hq + Hk, D], each head RMS-normed (`q_norm`
    for the first `num_q`, `k_norm` for the rest) then rotated by cos/sin [T, D]. One launch where the
    fused kernels serve (`fused_ops.qk_norm_rotary`), else the layers; written to `out` (shaped like qk; it
    may be qk itself, e.g. a view of the qkv rows, so no copy joins q and k to v again) or a new tensor."""

    def unfused() -> torch.Tensor:
        both = torch.cat([apply_rotary(q_norm(qk[:, :num_q]), cos, sin), apply_rotary(k_norm(qk[:, num_q:]), cos, sin)],
                         dim=1)
        return both if out is None else out.copy_(both)

    ops = FUSED.ops_for(qk)
    if ops is None or cos.stride(1) != 1 or q_norm.eps != k_norm.eps:
        return unfused()
    return _QK_NORM_ROTARY.run(
        lambda: ops.qk_norm_rotary(qk, q_norm.weight, k_norm.weight, num_q, cos, sin, q_norm.eps, out=out), unfused)


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


@dataclass(frozen=True)
class HeadShard:
    """Rank `index` of `size` in a tensor-parallel group over attention heads (`group`, a
    torch.distributed process group)."""

    index: int
    size: int
    group: Any

    def local_spec(self, spec: AttentionSpec) -> AttentionSpec:
        """The spec of this rank's share: num_heads and num_kv_heads divided by the group size."""
        if spec.num_heads % self.size or spec.num_kv_heads % self.size:
            raise ValueError(f"tensor parallelism over {self.size} ranks needs num_heads={spec.num_heads} and "
                             f"num_kv_heads={spec.num_kv_heads} divisible by it")
        return replace(spec, num_heads=spec.num_heads // self.size, num_kv_heads=spec.num_kv_heads // self.size)

    def take_qkv(self, spec: AttentionSpec, whole: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the whole layer's fused qkv weight [(Hq + 2 Hkv) D, ...] or bias: its q,
        then its k, then its v heads."""
        d, q, kv = spec.head_dim, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        part_q, part_kv = q // self.size, kv // self.size
        if whole.shape[0] != q + 2 * kv:
            raise ValueError(f"expected a fused qkv of {q + 2 * kv} rows (head_dim {d}), got {tuple(whole.shape)}")
        starts = (self.index * part_q, q + self.index * part_kv, q + kv + self.index * part_kv)
        return torch.cat([whole[starts[0] : starts[0] + part_q], whole[starts[1] : starts[1] + part_kv],
                          whole[starts[2] : starts[2] + part_kv]])

    def take_o(self, spec: AttentionSpec, whole: torch.Tensor) -> torch.Tensor:
        """This rank's columns of the whole layer's output projection weight [hidden, Hq D]."""
        part = spec.num_heads * spec.head_dim // self.size
        return whole[:, self.index * part : (self.index + 1) * part]


class SelfAttention(nn.Module):
    """Causal self-attention whose cache and kernel belong to the backend passed to `forward`; with
    `shard`, this rank's share of the heads (module docstring): `spec` is its share, `whole_spec` the layer's."""

    def __init__(self, spec: AttentionSpec, layer_idx: int, shard: HeadShard | None = None) -> None:
        super().__init__()
        self.whole_spec = spec
        self.shard = shard
        if shard is not None:
            if spec.o_bias:
                raise ValueError("tensor-parallel attention with an o_proj bias is not supported")
            spec = shard.local_spec(spec)
        self.spec = spec
        self.layer_idx = layer_idx
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Any) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `attn` is an AttentionBackend already prepared for the batch."""
        out = self._local(x, cos, sin, attn)
        if self.shard is not None and self.shard.size > 1:
            torch.distributed.all_reduce(out, group=self.shard.group)  # the ranks' o_proj shares summed
        return out

    def _local(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Any) -> torch.Tensor:
        t, d = x.shape[0], self.spec.head_dim
        qkv = linear(x, self.qkv_proj)
        ops = FUSED.ops_for(qkv)
        if ops is not None and qkv.is_contiguous() and cos.stride(1) == 1:
            heads = qkv.view(t, -1, d)
            num_q, num_kv = self.spec.num_heads, self.spec.num_kv_heads
            # q and k heads sit side by side in each qkv row: one launch norms (Qwen3) and rotates both.
            if self.spec.qk_norm:
                qk = normed_rotated_qk(heads[:, :num_q + num_kv], self.q_norm, self.k_norm, num_q, cos, sin)
            else:
                qk = ops.rotary(heads[:, :num_q + num_kv], cos, sin)
            q, k = qk.split([num_q, num_kv], dim=1)
            out = attn.forward(self.layer_idx, q, k, heads[:, num_q + num_kv:])
            return linear(out.reshape(t, self.q_size), self.o_proj)
        heads = qkv.reshape(t, -1, d)
        num_q, num_kv = self.spec.num_heads, self.spec.num_kv_heads
        qk, v = heads[:, :num_q + num_kv], heads[:, num_q + num_kv:]
        if self.spec.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :num_q]), self.k_norm(qk[:, num_q:])], dim=1)
        q, k = apply_rotary(qk, cos, sin).split([num_q, num_kv], dim=1)  # q and k heads rotated in one pass
        out = attn.forward(self.layer_idx, q, k, v)
        return linear(out.reshape(t, self.q_size), self.o_proj)
