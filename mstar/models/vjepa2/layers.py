"""The transformer block every V-JEPA 2 network uses: pre-norm attention (fused qkv, optional 3D RoPE,
optional KV cache) and an exact-GELU MLP (`layers.mlp.GeluMLP`); `Blocks` runs a stack of them with each
residual add fused with the LayerNorm after it.

On CUDA in bf16/fp16 the MLP's GELU runs in fc1's cuBLASLt epilogue, which computes the tanh approximation:
its distance from the exact GELU (at most 4.7e-4) is a tenth or less of bf16's rounding of the GELU's output
(RMS over N(0, 1) to N(0, 4) inputs), and the predictor's output with it is as far from the float32
exact-GELU predictor's as the bf16 exact-GELU output is (docs/benchmarks.md, V-JEPA 2)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.linear import linear
from mstar.layers.mlp import GeluMLP
from mstar.layers.norm import add_layer_norm
from mstar.models.vjepa2.config import ViTShape
from mstar.models.vjepa2.rope import apply_rope


class LayerKV:
    """One layer's keys and values for a batch, preallocated [B, heads, capacity, head_dim]; positions
    [0, length) are filled. The tensors may be the first rows of a larger preallocated cache."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int = 0) -> None:
        self.keys, self.values, self.length = keys, values, length

    def reserve(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next `n` slots after the filled part, as views [B, heads, n, head_dim] of keys and values
        for the caller to write; they count as filled from now on."""
        start, end = self.length, self.length + n
        if end > self.keys.shape[2]:
            raise ValueError(f"KV cache holds {self.keys.shape[2]} tokens; {end} needed")
        self.length = end
        return self.keys[:, :, start:end], self.values[:, :, start:end]

    def filled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key and value written so far, [B, heads, length, head_dim] views."""
        return self.keys[:, :, :self.length], self.values[:, :, :self.length]


class Attention(nn.Module):
    """Multi-head self-attention with one qkv projection; RoPE tables and a KV cache are optional. Both
    projections go through `layers.linear.linear`, as the MLP's do, so every linear of a block takes one path."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None, cache: LayerKV | None = None) -> torch.Tensor:
        """x [B, N, width]; `mask` [N, keys] bool (True: attend) or None (everything); with `cache`,
        the new keys and values are appended and the queries attend to the whole cache."""
        batch, n, width = x.shape
        q, k, v = linear(x, self.qkv).view(batch, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # each [B, h, N, d]
        # with a cache, the rotated keys are written straight into their slots (no second copy of them), and
        # the values go to theirs in the same pass
        k_slot, v_slot = cache.reserve(n) if cache is not None else (None, None)
        if rope is not None:
            q = apply_rope(q, *rope)
            k = apply_rope(k, *rope, out=k_slot, carry=(v, v_slot) if cache is not None else None)
        elif cache is not None:
            k_slot.copy_(k)
            v_slot.copy_(v)
        if cache is not None:
            k, v = cache.filled()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return linear(out.transpose(1, 2).reshape(batch, n, width), self.proj)


class Block(nn.Module):
    """x + attn(norm1(x)); then x + mlp(norm2(x))."""

    def __init__(self, shape: ViTShape) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(shape.hidden_size, eps=shape.layer_norm_eps)
        self.attn = Attention(shape.hidden_size, shape.num_heads)
        self.norm2 = nn.LayerNorm(shape.hidden_size, eps=shape.layer_norm_eps)
        self.mlp = GeluMLP(shape.hidden_size, shape.mlp_size, approximate="none", gemm_epilogue=True)

    def forward(self, x: torch.Tensor, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None, cache: LayerKV | None = None,
                next_norm: nn.LayerNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (the residual stream) and h = norm1(x) -> (x', next_norm(x') or None): the next block's norm
        is applied here so that this block's last residual add fuses with it."""
        x, h = add_layer_norm(x, self.attn(h, rope, mask, cache), self.norm2)
        delta = self.mlp(h)
        if next_norm is None:
            return x + delta, None
        return add_layer_norm(x, delta, next_norm)


class Blocks(nn.ModuleList):
    """A stack of `Block`s (a module list, so checkpoint names stay `blocks.<i>.`) and its forward."""

    def run(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
            mask: torch.Tensor | None = None, caches: Sequence[LayerKV] | None = None) -> torch.Tensor:
        """x [B, N, width] through every block (`caches`: one `LayerKV` per block, or None)."""
        _, h = add_layer_norm(x, None, self[0].norm1)
        for i, block in enumerate(self):
            following = self[i + 1].norm1 if i + 1 < len(self) else None
            x, h = block(x, h, rope, mask, caches[i] if caches is not None else None, following)
        return x


def blocks(shape: ViTShape) -> Blocks:
    """`shape.num_layers` blocks."""
    return Blocks(Block(shape) for _ in range(shape.num_layers))
