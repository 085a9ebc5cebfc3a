"""BAGEL's vision encoder: SigLIP's NaViT (variable resolution, images packed without padding) and the
MLP connector into the LLM's width.

An image of any size whose sides are multiples of the patch size becomes its patches (`patchify`), each
with the learned position embedding of its grid cell; the SigLIP layers (`layers/siglip.py`) let every
image attend over its own patches only. The connector (Linear-GELU-Linear) maps the encoder's last layer
to the LLM's width and adds the LLM's 2D sine-cosine position of the patch. Module names follow the
checkpoint (`vit_model.vision_model.*`, `connector.*`, `vit_pos_embed.*`) with q/k/v fused (weights.py
places them).
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.layers.linear import linear
from mstar.layers.mlp import GeluMLP
from mstar.layers.siglip import SiglipShape, SiglipTower
from mstar.models.bagel.embeddings import PositionEmbedding


class ViTEmbeddings(nn.Module):
    """Patch pixels [N, 3 * p * p] -> [N, D] plus the learned embedding of each patch's grid position."""

    def __init__(self, cfg: SiglipShape) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(cfg.patch_dim, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.grid_side**2, cfg.hidden_size)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return linear(patches.to(self.patch_embedding.weight.dtype), self.patch_embedding) + self.position_embedding(positions)


class SiglipNaViT(SiglipTower):
    """Packed patches of several images [N, 3 * p * p] (image after image, `lengths` patches each) with
    their grid positions [N] -> the encoder's normed last hidden states [N, D]."""

    def __init__(self, cfg: SiglipShape) -> None:
        super().__init__(cfg, ViTEmbeddings(cfg))

    def forward(self, patches: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        return self.encode(self.embeddings(patches, positions), lengths)


class VisionTower(nn.Module):
    """The `vit` component's network: encoder, connector and the LLM-side position table.

    (patches [N, 3 * p * p], grid positions [N], patches per image) -> LLM input embeddings [N, llm hidden].
    Both position tables (the ViT's and the LLM-side one) are read at the same flattened grid positions."""

    def __init__(self, cfg: SiglipShape, llm_hidden: int, max_patches_per_side: int) -> None:
        super().__init__()
        self.vit = SiglipNaViT(cfg)
        self.connector = GeluMLP(cfg.hidden_size, llm_hidden, llm_hidden)  # ViT width -> LLM width
        self.vit_pos_embed = PositionEmbedding(max_patches_per_side, llm_hidden)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        return self.connector(self.vit(patches, positions, lengths)) + self.vit_pos_embed(positions)
