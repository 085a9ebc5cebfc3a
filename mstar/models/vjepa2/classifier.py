"""V-JEPA 2's video classifier head: an attentive pooler over the encoder's latents, then a linear layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.mlp import GeluMLP
from mstar.models.vjepa2.config import ClassifierConfig, ViTShape
from mstar.models.vjepa2.layers import blocks


class CrossAttentionLayer(nn.Module):
    """One learned query attends to the normed latents (no output projection), then a residual MLP."""

    def __init__(self, shape: ViTShape) -> None:
        super().__init__()
        width = shape.hidden_size
        self.heads = shape.num_heads
        self.norm1 = nn.LayerNorm(width, eps=shape.layer_norm_eps)
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * width)
        self.norm2 = nn.LayerNorm(width, eps=shape.layer_norm_eps)
        self.mlp = GeluMLP(width, shape.mlp_size, approximate="none")

    def forward(self, queries: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        batch, n, width = latents.shape
        q = self.q(queries).view(batch, queries.shape[1], self.heads, -1).transpose(1, 2)
        k, v = self.kv(self.norm1(latents)).view(batch, n, 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        pooled = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, -1, width)
        x = queries + pooled
        return x + self.mlp(self.norm2(x))


class VideoClassifier(nn.Module):
    """latents [B, N, D] -> logits [B, num_labels]."""

    def __init__(self, config: ClassifierConfig, encoder: ViTShape) -> None:
        super().__init__()
        pooler_shape = ViTShape(encoder.hidden_size, config.num_pooler_layers, encoder.num_heads, 4.0,
                                encoder.layer_norm_eps)
        self.query_tokens = nn.Parameter(torch.zeros(1, 1, encoder.hidden_size))
        self.layers = blocks(pooler_shape)
        self.cross = CrossAttentionLayer(pooler_shape)
        self.head = nn.Linear(encoder.hidden_size, config.num_labels)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        x = self.layers.run(latents)
        pooled = self.cross(self.query_tokens.expand(x.shape[0], -1, -1), x)
        return self.head(pooled[:, 0])
