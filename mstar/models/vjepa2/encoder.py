"""The V-JEPA 2 video encoder and its mask predictor.

The encoder cuts a clip [B, T, C, H, W] (normalised pixels) into tubelets of `tubelet_size` frames x
`patch_size`^2 pixels and returns one latent per tubelet, frame-major then row-major. The mask predictor
(the pretraining head) maps the latents of context tubelets and a learned mask token at each target
position to predictions of the targets' latents.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.models.vjepa2.config import EncoderConfig, MaskPredictorConfig
from mstar.models.vjepa2.layers import blocks
from mstar.models.vjepa2.rope import grid_positions, ids_to_positions, rope_tables


class VJEPA2Encoder(nn.Module):
    """Video -> tubelet latents [B, T/tubelet * H/patch * W/patch, hidden]."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        size = (config.tubelet_size, config.patch_size, config.patch_size)
        self.patch_embed = nn.Conv3d(config.in_chans, config.vit.hidden_size, kernel_size=size, stride=size)
        self.blocks = blocks(config.vit)
        self.norm = nn.LayerNorm(config.vit.hidden_size, eps=config.vit.layer_norm_eps)

    def grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(tubelets in time, rows, columns) of a clip; a clip shorter than a tubelet is repeated to fill one."""
        c = self.config
        return max(frames, c.tubelet_size) // c.tubelet_size, height // c.patch_size, width // c.patch_size

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        """video [B, T, C, H, W]: frames beyond the last whole tubelet are left out, as the checkpoints'
        reference does."""
        x = video.permute(0, 2, 1, 3, 4).to(self.patch_embed.weight.dtype)
        if x.shape[2] < self.config.tubelet_size:
            x = x.repeat(1, 1, self.config.tubelet_size, 1, 1)
        x = self.patch_embed(x)  # [B, D, t, h, w]
        frames, rows, cols = x.shape[2:]
        # contiguous: the residual adds keep x's layout, and `add_norm` fuses only contiguous rows
        x = x.flatten(2).transpose(1, 2).contiguous()
        rope = rope_tables(grid_positions(frames, rows, cols, x.device), self.config.vit.head_dim)
        x = self.blocks.run(x, rope)
        return self.norm(x)


class MaskPredictor(nn.Module):
    """(latents of context tubelets, target positions) -> predicted latents of the targets."""

    def __init__(self, config: MaskPredictorConfig, encoder_width: int) -> None:
        super().__init__()
        self.config = config
        width = config.vit.hidden_size
        self.embed = nn.Linear(encoder_width, width)
        self.mask_tokens = nn.Parameter(torch.zeros(config.num_mask_tokens, 1, 1, width))
        self.blocks = blocks(config.vit)
        self.norm = nn.LayerNorm(width, eps=config.vit.layer_norm_eps)
        self.proj = nn.Linear(width, encoder_width)

    def forward(self, latents: torch.Tensor, context_ids: torch.Tensor, target_ids: torch.Tensor,
                grid: tuple[int, int], mask_index: int = 1) -> torch.Tensor:
        """latents [B, N, D] of the whole clip; context_ids [B, Nc] and target_ids [B, Nt] index its
        tokens; `grid` (rows, columns) per frame. Returns [B, Nt, D]."""
        context = torch.gather(latents, 1, context_ids.unsqueeze(-1).expand(-1, -1, latents.shape[-1]))
        token = self.mask_tokens[mask_index % self.config.num_mask_tokens].reshape(1, 1, -1)
        targets = token.expand(latents.shape[0], target_ids.shape[1], -1)
        x = torch.cat([self.embed(context), targets.to(context.dtype)], dim=1)
        ids = torch.cat([context_ids, target_ids], dim=1)
        cos, sin = rope_tables(ids_to_positions(ids, *grid), self.config.vit.head_dim)
        rope = (cos.unsqueeze(1), sin.unsqueeze(1))  # one table per batch row, shared by its heads
        x = self.blocks.run(x, rope)
        return self.proj(self.norm(x[:, context_ids.shape[1]:]))
