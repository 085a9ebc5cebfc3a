"""The Wan2.2 VAE: video <-> 48-channel latents, 16x smaller in space and 4x in time (after frame 0).

`WanVAE.encode` gives the posterior mean, normalised with the checkpoint's latents_mean/std (what the
DiT sees and what image-to-video conditions on); `WanVAE.decode` takes normalised latents back to a
video in [-1, 1]. Both stream over time through causal layers, so decoding holds one latent frame
(a few output frames) of activations at a time; `decode(tiling=...)` also splits space into tiles.
On CUDA the decoder runs channels-last with its convolutions' biases folded (`vae_channels_last.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn

from mstar.models.common.wan_vae.vae_blocks import ResidualDownBlock, ResidualUpBlock
from mstar.models.common.wan_vae.vae_channels_last import decode_chunk, to_channels_last
from mstar.models.common.wan_vae.vae_config import WanVAEConfig
from mstar.models.common.wan_vae.vae_layers import (
    CausalConv3d,
    CausalStream,
    ChannelRMSNorm,
    MidBlock,
    patchify,
    unpatchify,
)
from mstar.models.common.wan_vae.vae_tiling import TileSpec, decode_tiled

logger = logging.getLogger(__name__)


def _levels(block: type[ResidualDownBlock | ResidualUpBlock], dims: list[int], num_res_blocks: int,
            temporal: tuple[bool, ...]) -> nn.ModuleList:
    """One `block` per level, from width dims[i] to dims[i + 1]; every level but the last resamples in
    space, and in time where `temporal` says."""
    last = len(dims) - 2
    return nn.ModuleList(block(dims[i], dims[i + 1], num_res_blocks, i < last and temporal[i], i < last)
                         for i in range(last + 1))


class Encoder(nn.Module):
    """Patchified video [B, in_channels, T, H, W] -> posterior mean and log-variance [B, 2 z, T', H', W']."""

    def __init__(self, config: WanVAEConfig) -> None:
        super().__init__()
        dims = [config.base_dim * m for m in (1, *config.dim_mult)]
        self.conv_in = CausalConv3d(config.in_channels, dims[0], 3)
        self.down_blocks = _levels(ResidualDownBlock, dims, config.num_res_blocks, config.temperal_downsample)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = ChannelRMSNorm(dims[-1], spatial_dims=3)
        self.conv_out = CausalConv3d(dims[-1], 2 * config.z_dim, 3)

    def forward(self, x: torch.Tensor, stream: CausalStream) -> torch.Tensor:
        """One chunk of frames; `stream` carries the causal context of the earlier chunks."""
        x = self.conv_in(x, stream)
        for block in self.down_blocks:
            x = block(x, stream)
        x = self.mid_block(x, stream)
        return self.conv_out(self.norm_out(x, silu=True), stream)


class Decoder(nn.Module):
    """Latents [B, z, T', H', W'] -> patchified video [B, out_channels, T, H, W]."""

    def __init__(self, config: WanVAEConfig) -> None:
        super().__init__()
        dims = [config.decoder_base_dim * m for m in (config.dim_mult[-1], *reversed(config.dim_mult))]
        self.conv_in = CausalConv3d(config.z_dim, dims[0], 3)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = _levels(ResidualUpBlock, dims, config.num_res_blocks, config.temperal_upsample)
        self.norm_out = ChannelRMSNorm(dims[-1], spatial_dims=3)
        self.conv_out = CausalConv3d(dims[-1], config.out_channels, 3)

    def forward(self, z: torch.Tensor, stream: CausalStream) -> torch.Tensor:
        """One chunk of latent frames; `stream` carries the causal context of the earlier chunks."""
        x = self.mid_block(self.conv_in(z, stream), stream)
        for block in self.up_blocks:
            x = block(x, stream)
        return self.conv_out(self.norm_out(x, silu=True), stream)


class WanVAE(nn.Module):
    """The Wan2.2 VAE with Diffusers parameter names (`AutoencoderKLWan` state dicts load as they are)."""

    def __init__(self, config: WanVAEConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.quant_conv = CausalConv3d(2 * config.z_dim, 2 * config.z_dim, 1)
        self.post_quant_conv = CausalConv3d(config.z_dim, config.z_dim, 1)
        self.decoder = Decoder(config)
        # Decode channels-last (`vae_channels_last.py`)? None: on CUDA. `decode(channels_last=...)` overrides.
        self.channels_last: bool | None = None
        # The channels-last decode's convolutions in this dtype (e.g. float16 for a float32 VAE; None: the
        # weights' dtype); the residual stream, biases and sums stay in the weights' dtype.
        self.conv_dtype: torch.dtype | None = None

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """(channels, frames, height, width) of the latents of a video; ValueError when it cannot be encoded."""
        c = self.config
        if (frames - 1) % c.scale_factor_temporal or height % c.scale_factor_spatial or width % c.scale_factor_spatial:
            raise ValueError(
                f"a {frames}-frame {height}x{width} video cannot be encoded: frames must be 1 + "
                f"{c.scale_factor_temporal}k and height and width multiples of {c.scale_factor_spatial}"
            )
        return (
            c.z_dim,
            1 + (frames - 1) // c.scale_factor_temporal,
            height // c.scale_factor_spatial,
            width // c.scale_factor_spatial,
        )

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Raw posterior latents -> the normalised latents the DiT works in (float32)."""
        mean, std = self._stats(latents.device)
        return (latents.float() - mean) / std

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of `normalize` (float32)."""
        mean, std = self._stats(latents.device)
        return latents.float() * std + mean

    def _stats(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Built per call (48 numbers) rather than buffers, so meta-device construction needs no refill.
        shape = (1, self.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.config.latents_mean, dtype=torch.float32, device=device).view(shape)
        std = torch.tensor(self.config.latents_std, dtype=torch.float32, device=device).view(shape)
        return mean, std

    @torch.no_grad()
    def encode(self, video: torch.Tensor, chunk_frames: int | None = 4) -> torch.Tensor:
        """video [B, 3, F, H, W] in [-1, 1] (F = 1 + 4k) -> normalised posterior mean [B, z, F', H', W'].

        Frame 0 is encoded alone, then `chunk_frames` frames (a multiple of 4) at a time; None encodes
        the whole video in one pass (same result, more memory).
        """
        if video.ndim != 5 or video.shape[1] != 3:
            raise ValueError(f"video of shape {tuple(video.shape)}: expected [B, 3, F, H, W] in [-1, 1]")
        self.latent_shape(*video.shape[2:])
        step = self.config.scale_factor_temporal
        if chunk_frames is not None and (chunk_frames <= 0 or chunk_frames % step):
            raise ValueError(f"chunk_frames={chunk_frames} must be a positive multiple of {step}, or None")
        x = patchify(video.to(self._dtype()), self.config.patch_size)
        stream = CausalStream()
        frames = x.shape[2]
        starts = [0] if chunk_frames is None else [0, *range(1, frames, chunk_frames)]
        ends = [*starts[1:], frames]
        chunks = [self.encoder(x[:, :, a:b], stream) for a, b in zip(starts, ends, strict=True)]
        moments = self.quant_conv(torch.cat(chunks, dim=2))
        return self.normalize(moments[:, : self.config.z_dim])

    @torch.no_grad()
    def decode(
        self,
        latents: torch.Tensor,
        chunk_frames: int | None = 1,
        tiling: TileSpec | None = None,
        channels_last: bool | None = None,
    ) -> torch.Tensor:
        """Normalised latents [B, z, F', H', W'] -> video [B, 3, 1 + 4 (F' - 1), 16 H', 16 W'] in [-1, 1].

        Decodes `chunk_frames` latent frames at a time (None: all at once; same result, more memory);
        `tiling` also decodes overlapping spatial tiles and blends them (memory bounded by tile size).
        `channels_last` (None: `self.channels_last`, else on for CUDA) runs the decoder in NDHWC memory
        with its conv weights made channels-last in place on first use; same result up to float32 rounding.
        """
        if tiling is None:
            return torch.cat(list(self.decode_chunks(latents, chunk_frames, channels_last)), dim=2)
        z, decoder = self._post_quant(latents, chunk_frames, channels_last)
        out = decode_tiled(lambda tile: self._decode_frames(decoder, tile, chunk_frames), z, tiling, self.config)
        return unpatchify(out, self.config.patch_size).float().clamp_(-1.0, 1.0)

    @torch.no_grad()
    def decode_chunks(
        self, latents: torch.Tensor, chunk_frames: int | None = 1, channels_last: bool | None = None,
        finite: torch.Tensor | None = None,
    ) -> Iterator[torch.Tensor]:
        """Like `decode`, but yields the video chunk by chunk as it is decoded (1 frame, then 4 per latent).

        Lets a caller encode or send frames while later ones decode, holding only one chunk of pixels.
        `finite` (a bool tensor on the latents' device) is and-ed with whether every chunk was finite before
        clamping, on the device: a float16 overflow shows there without a host wait per chunk.
        """
        z, decoder = self._post_quant(latents, chunk_frames, channels_last)
        step = chunk_frames or z.shape[2]
        stream = CausalStream()
        for i in range(0, z.shape[2], step):
            frames = decoder(z[:, :, i : i + step], stream)
            if finite is not None:
                finite.logical_and_(torch.isfinite(frames).all())
            yield unpatchify(frames, self.config.patch_size).float().clamp_(-1.0, 1.0)

    def _post_quant(
        self, latents: torch.Tensor, chunk_frames: int | None, channels_last: bool | None
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor, CausalStream], torch.Tensor]]:
        """The decoder's input z and the decoder: `self.decoder`, or (asked, or by default on CUDA) its
        channels-last walk, z made channels-last here once and the weights on first use."""
        if latents.ndim != 5 or latents.shape[1] != self.config.z_dim:
            raise ValueError(
                f"latents of shape {tuple(latents.shape)}: expected [B, {self.config.z_dim}, F', H', W']"
            )
        if chunk_frames is not None and chunk_frames <= 0:
            raise ValueError(f"chunk_frames={chunk_frames} must be positive, or None")
        z = self.post_quant_conv(self.denormalize(latents).to(self._dtype()))
        if not (self.runs_channels_last(z.device) if channels_last is None else channels_last):
            return z, self.decoder
        to_channels_last(self.decoder)  # a no-op when the weights already are
        decode = partial(decode_chunk, self.decoder, conv_dtype=self.conv_dtype)
        return z.contiguous(memory_format=torch.channels_last_3d), decode

    def runs_channels_last(self, device: torch.device) -> bool:
        """Whether a decode on `device` takes the channels-last walk by default (`self.channels_last`, or CUDA)."""
        return device.type == "cuda" if self.channels_last is None else self.channels_last

    @staticmethod
    def _decode_frames(
        decoder: Callable[[torch.Tensor, CausalStream], torch.Tensor], z: torch.Tensor, chunk_frames: int | None
    ) -> torch.Tensor:
        """Patchified frames of post-quant latents z, streaming `chunk_frames` latent frames at a time."""
        step = chunk_frames or z.shape[2]
        stream = CausalStream()
        return torch.cat([decoder(z[:, :, i : i + step], stream) for i in range(0, z.shape[2], step)], 2)

    def _dtype(self) -> torch.dtype:
        return self.post_quant_conv.weight.dtype


def frames_to_uint8(video: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """video [B, 3, F, H, W] in [-1, 1] -> uint8 frames [B, F, H, W, 3] on the CPU (rounded, clamped).

    `non_blocking` with a CUDA video: the frames are copied into pinned host memory behind the work
    queued on the current stream and the host does not wait; the caller synchronizes that stream before
    reading them (a decode loop then queues its next chunk while this one's frames travel)."""
    if video.ndim != 5 or video.shape[1] != 3:
        raise ValueError(f"video of shape {tuple(video.shape)}: expected [B, 3, F, H, W]")
    pixels = ((video.float() + 1.0) * 127.5).round_().clamp_(0, 255).to(torch.uint8)
    pixels = pixels.permute(0, 2, 3, 4, 1).contiguous()
    if not (non_blocking and pixels.is_cuda):
        return pixels.cpu()
    host = torch.empty(pixels.shape, dtype=torch.uint8, pin_memory=True)
    return host.copy_(pixels, non_blocking=True)
