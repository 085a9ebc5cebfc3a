"""SigLIP's vision transformer after its patch embeddings, shared by the models that see through it
(BAGEL's NaViT, Pi0.5's PaliGemma tower).

Each model keeps its own patch and position front-end (`SiglipTower.embeddings`): a Linear over patches
of any grid with a position table indexed by grid cell, or a convolution over fixed-size images, since
they differ in how pixels arrive and in their checkpoint tensors. Behind it the patches of every image
travel packed, image after image, a `SegmentPlan` saying which attend to which (a batch of same-size
images is a plan of one length). Module names are transformers' `SiglipVisionTransformer`'s, with q, k
and v fused into `self_attn.qkv_proj` (`checkpoint_name` places a transformers name).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.layers.linear import linear
from mstar.layers.mlp import GeluMLP
from mstar.layers.norm import add_layer_norm
from mstar.layers.segment_attention import SegmentPlan, segment_attention


@dataclass(frozen=True)
class SiglipShape:
    """SigLIP's vision tower without its pooling head; the defaults are so400m/14 at 224 pixels."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_layers: int = 27
    num_heads: int = 16
    patch_size: int = 14
    image_size: int = 224  # the side the position table covers: patches per side = image_size / patch_size
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.image_size % self.patch_size:
            raise ValueError(f"SigLIP: hidden_size {self.hidden_size} must divide by num_heads {self.num_heads} "
                             f"and image_size {self.image_size} by patch_size {self.patch_size}")

    @property
    def grid_side(self) -> int:
        """Patches per side of the position table's grid."""
        return self.image_size // self.patch_size

    @property
    def tokens(self) -> int:
        """Patches of an image of `image_size` pixels a side: one token each."""
        return self.grid_side**2

    @property
    def patch_dim(self) -> int:
        """Pixels of one RGB patch."""
        return 3 * self.patch_size**2

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> SiglipShape:
        """From a transformers `SiglipVisionConfig` dict (a checkpoint's vision config)."""
        return cls(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                   num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                   patch_size=cfg["patch_size"], image_size=cfg["image_size"],
                   layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-6)))


class SiglipAttention(nn.Module):
    """Bidirectional multi-head attention among each image's patches; q, k and v as one projection."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv_proj = nn.Linear(width, 3 * width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        """x [N, width] packed -> [N, width]."""
        n, width = x.shape
        q, k, v = linear(x, self.qkv_proj).view(n, 3, self.heads, width // self.heads).unbind(1)
        return linear(segment_attention(q, k, v, plan).reshape(n, width), self.out_proj)


class SiglipLayer(nn.Module):
    """Pre-LayerNorm block: x + attention(layer_norm1(x)), then x + tanh-GELU MLP(layer_norm2(x))."""

    def __init__(self, shape: SiglipShape) -> None:
        super().__init__()
        width = shape.hidden_size
        self.layer_norm1 = nn.LayerNorm(width, eps=shape.layer_norm_eps)
        self.self_attn = SiglipAttention(width, shape.num_heads)
        self.layer_norm2 = nn.LayerNorm(width, eps=shape.layer_norm_eps)
        self.mlp = GeluMLP(width, shape.intermediate_size)

    def forward(self, x: torch.Tensor, h: torch.Tensor, plan: SegmentPlan, next_norm: nn.LayerNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (the residual stream) and h = layer_norm1(x) -> (x', next_norm(x')): the norm after the block
        is applied here so that each residual add fuses with the LayerNorm that follows it."""
        x, h = add_layer_norm(x, self.self_attn(h, plan), self.layer_norm2)
        return add_layer_norm(x, self.mlp(h), next_norm)


class SiglipEncoder(nn.Module):
    """`shape.num_layers` layers over packed patch embeddings [N, width]."""

    def __init__(self, shape: SiglipShape) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(shape) for _ in range(shape.num_layers))

    def forward(self, x: torch.Tensor, plan: SegmentPlan, final_norm: nn.LayerNorm) -> torch.Tensor:
        """final_norm(the last layer's output)."""
        x = x.contiguous()  # the residual adds keep x's layout, and `add_layer_norm` fuses only contiguous rows
        _, h = add_layer_norm(x, None, self.layers[0].layer_norm1)
        for i, layer in enumerate(self.layers):
            following = self.layers[i + 1].layer_norm1 if i + 1 < len(self.layers) else final_norm
            x, h = layer(x, h, plan, following)
        return h


class SiglipTower(nn.Module):
    """A model's patch front-end (`embeddings`), the encoder and the final LayerNorm; the model's forward
    embeds its inputs and calls `encode`."""

    def __init__(self, shape: SiglipShape, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.encoder = SiglipEncoder(shape)
        self.post_layernorm = nn.LayerNorm(shape.hidden_size, eps=shape.layer_norm_eps)

    def encode(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Patch embeddings [N, width], image after image with `lengths` patches each -> the normed last
        hidden states [N, width]."""
        return self.encoder(x, SegmentPlan(lengths, x.device), self.post_layernorm)


_QKV = re.compile(r"(encoder\.layers\.\d+\.self_attn\.)([qkv])_proj\.(weight|bias)")


def checkpoint_name(name: str, width: int) -> tuple[str, int]:
    """A tensor name under transformers' `vision_model.` -> (our name in `SiglipTower`, first row it fills):
    q, k and v fill the thirds of `qkv_proj`; every other name is ours as it is."""
    match = _QKV.fullmatch(name)
    if match is None:
        return name, 0
    return f"{match[1]}qkv_proj.{match[3]}", "qkv".index(match[2]) * width
