"""The SigLIP vision tower of PaliGemma and its projection: one image -> one Gemma-width token per patch.

Images arrive as float [N, 3, S, S] in [-1, 1]; every image of a batch (all cameras of all robots) is one
forward. Attention is plain bidirectional self-attention over an image's patches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.pi05.config import SiglipShape


class SiglipBlock(nn.Module):
    """Pre-norm transformer block: LayerNorm, self-attention (fused qkv with biases), LayerNorm, GELU MLP."""

    def __init__(self, shape: SiglipShape) -> None:
        super().__init__()
        width, self.num_heads = shape.hidden_size, shape.num_heads
        self.norm1 = nn.LayerNorm(width, eps=shape.layer_norm_eps)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, eps=shape.layer_norm_eps)
        self.fc1 = nn.Linear(width, shape.mlp_size)
        self.fc2 = nn.Linear(shape.mlp_size, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.num_heads, width // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, width)
        x = x + self.proj(attended)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class SiglipEncoder(nn.Module):
    """images [N, 3, S, S] -> image tokens [N, (S / patch)^2, out_width] (the projector's output)."""

    def __init__(self, shape: SiglipShape, out_width: int) -> None:
        super().__init__()
        width = shape.hidden_size
        self.patch_embed = nn.Conv2d(3, width, kernel_size=shape.patch_size, stride=shape.patch_size)
        self.pos_embed = nn.Parameter(torch.empty(shape.tokens, width))
        self.blocks = nn.ModuleList(SiglipBlock(shape) for _ in range(shape.num_layers))
        self.norm = nn.LayerNorm(width, eps=shape.layer_norm_eps)
        self.projector = nn.Linear(width, out_width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.projector(self.norm(x))
