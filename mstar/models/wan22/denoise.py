"""Small pure functions around one Wan2.2 denoising step: first-frame conditioning and timesteps.

Text-to-video: every latent frame is noise and denoised at the step's timestep. Image-to-video
(TI2V-5B): the first latent frame is the encoded image; it is written over the noisy latents before
every DiT call and after the last step, and its tokens are conditioned on timestep 0.
"""

from __future__ import annotations

import torch


def blend_first_frame(latents: torch.Tensor, condition: torch.Tensor | None) -> torch.Tensor:
    """`latents` [B, C, F, H, W] with frame 0 replaced by `condition` [B, C, 1, H, W] (None: unchanged)."""
    if condition is None:
        return latents
    if condition.shape[2] != 1 or condition.shape[:2] != latents.shape[:2] or condition.shape[3:] != latents.shape[3:]:
        raise ValueError(f"condition of shape {tuple(condition.shape)} must be one latent frame of latents "
                         f"shaped {tuple(latents.shape)}")
    return torch.cat([condition.to(latents.dtype), latents[:, :, 1:]], dim=2)


def frame_timesteps(
    timestep: torch.Tensor | float, num_frames: int, first_frame_conditioned: bool, device: torch.device | None = None
) -> torch.Tensor:
    """[F'] float32: the step's timestep on every latent frame, 0 on a conditioning first frame."""
    ts = torch.full((num_frames,), float(timestep), dtype=torch.float32, device=device)
    if first_frame_conditioned:
        ts[0] = 0.0
    return ts


def token_timesteps(frame_ts: torch.Tensor, tokens_per_frame: int) -> torch.Tensor:
    """Per-frame timesteps [..., F'] spread to per-token [..., F' * tokens_per_frame] (diffusers' layout)."""
    return frame_ts.repeat_interleave(tokens_per_frame, dim=-1)
