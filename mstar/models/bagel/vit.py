"""BAGEL's vision encoder: SigLIP's NaViT (variable resolution, images packed without padding) and the
MLP connector into the LLM's width.

An image of any size whose sides are multiples of the patch size becomes its patches (`patchify`), each
with the learned position embedding of its grid cell; every image attends over its own patches only.
The connector (Linear-GELU-Linear) maps the encoder's last layer to the LLM's width and adds the LLM's
2D sine-cosine position of the patch. Module names follow the checkpoint (`vit_model.vision_model.*`,
`connector.*`, `vit_pos_embed.*`) with q/k/v fused (weights.py places them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.linear import linear
from mstar.models.bagel.config import ViTConfig
from mstar.models.bagel.embeddings import PositionEmbedding


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class ViTEmbeddings(nn.Module):
    """Patch pixels [N, 3 * p * p] -> [N, D] plus the learned embedding of each patch's grid position."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(cfg.patch_dim, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.max_side**2, cfg.hidden_size)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return linear(patches.to(self.patch_embedding.weight.dtype), self.patch_embedding) + self.position_embedding(positions)


class ViTLayer(nn.Module):
    """Pre-LayerNorm block: bidirectional attention within each image, then a tanh-GELU MLP."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.heads, self.dim = cfg.num_heads, cfg.hidden_size
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n, d = x.shape[0], self.dim // self.heads
        q, k, v = linear(self.layer_norm1(x), self.qkv_proj).reshape(n, 3, self.heads, d).unbind(1)
        attn = torch.cat([
            F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)).transpose(0, 1)
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)])
        x = x + linear(attn.reshape(n, self.dim), self.out_proj)
        return x + linear(gelu_tanh(linear(self.layer_norm2(x), self.fc1)), self.fc2)


class SiglipNaViT(nn.Module):
    """Packed patches of several images [N, 3 * p * p] (image after image, `lengths` patches each) with
    their grid positions [N] -> the encoder's normed last hidden states [N, D]."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = ViTEmbeddings(cfg)
        self.layers = nn.ModuleList(ViTLayer(cfg) for _ in range(cfg.num_layers))
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = self.embeddings(patches, positions)
        for layer in self.layers:
            x = layer(x, lengths)
        return self.post_layernorm(x)


class Connector(nn.Module):
    """ViT width -> LLM width: fc1, tanh-GELU, fc2."""

    def __init__(self, vit_dim: int, llm_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vit_dim, llm_dim)
        self.fc2 = nn.Linear(llm_dim, llm_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(gelu_tanh(linear(x, self.fc1)), self.fc2)


class VisionTower(nn.Module):
    """The `vit` component's network: encoder, connector and the LLM-side position table.

    (patches [N, 3 * p * p], grid positions [N], patches per image) -> LLM input embeddings [N, llm hidden].
    Both position tables (the ViT's and the LLM-side one) are read at the same flattened grid positions."""

    def __init__(self, cfg: ViTConfig, llm_hidden: int, max_patches_per_side: int) -> None:
        super().__init__()
        self.vit = SiglipNaViT(cfg)
        self.connector = Connector(cfg.hidden_size, llm_hidden)
        self.vit_pos_embed = PositionEmbedding(max_patches_per_side, llm_hidden)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        return self.connector(self.vit(patches, positions, lengths)) + self.vit_pos_embed(positions)
