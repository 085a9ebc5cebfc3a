"""The SigLIP vision tower of PaliGemma and its projection: one image -> one Gemma-width token per patch.

Images arrive as float [N, 3, S, S] in [-1, 1]; every image of a batch (all cameras of all robots) is one
forward. The front-end is PaliGemma's (a strided convolution and one learned position per patch of the
fixed grid); the layers are the shared SigLIP ones (`layers/siglip.py`), each image attending over its own
patches.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.layers.siglip import SiglipShape, SiglipTower


class PatchEmbeddings(nn.Module):
    """images [N, 3, S, S] -> [N, (S / patch)^2, width]: each patch's convolution plus its position's embedding."""

    def __init__(self, shape: SiglipShape) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, shape.hidden_size, kernel_size=shape.patch_size, stride=shape.patch_size)
        self.position_embedding = nn.Embedding(shape.tokens, shape.hidden_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(images.to(self.patch_embedding.weight.dtype))
        return x.flatten(2).transpose(1, 2) + self.position_embedding.weight


class VisionTower(SiglipTower):
    """images [N, 3, S, S] -> image tokens [N, (S / patch)^2, out_width] (the projector's output)."""

    def __init__(self, shape: SiglipShape, out_width: int) -> None:
        super().__init__(shape, PatchEmbeddings(shape))
        self.shape = shape
        self.projector = nn.Linear(shape.hidden_size, out_width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(images)
        n, tokens, width = x.shape
        x = self.encode(x.reshape(n * tokens, width), [tokens] * n)
        return self.projector(x).view(n, tokens, -1)
