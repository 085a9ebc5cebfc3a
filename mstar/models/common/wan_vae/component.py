"""The Wan2.2 VAE as the stateless engine runs it: an image to its condition latents, latents to frames.

Edges carry one request's tensors without a batch dimension: image [3, 1, H, W], latents [C, F', H', W'],
frames [T, H, W, 3]. Wan2.2 serves it as is; Cosmos3 extends node `encode_image`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from mstar.engines.base import StatelessBase
from mstar.models.common.wan_vae.vae import WanVAE, frames_to_uint8

logger = logging.getLogger(__name__)


class VAEComponent(StatelessBase, nn.Module):
    """Node `encode_image`: image [3, 1, H, W] in [-1, 1] -> condition [C, 1, H/16, W/16] (normalised).
    Node `decode`: latents [C, F', H', W'] -> "video" uint8 [T, H, W, 3], decoded `chunk_frames` latent
    frames at a time; "image" [H, W, 3] for a one-frame request that asks for images; with the
    `debug_outputs` option also "frames" float32 [T, H, W, 3] in [0, 1] (before rounding)."""

    def __init__(self, vae: WanVAE, chunk_frames: int = 1) -> None:
        super().__init__()
        self.vae = vae
        self.chunk_frames = chunk_frames

    @torch.no_grad()
    def run_batch(self, walk: str, node: str, inputs: list[dict], options: list[dict]) -> list[dict]:
        if node == "encode_image":
            return [{"condition": self.vae.encode(x["image"][None])[0]} for x in inputs]
        return [self._decode(x["latents"], opts) for x, opts in zip(inputs, options, strict=True)]

    def _decode(self, latents: torch.Tensor, options: dict) -> dict:
        debug = bool(options.get("debug_outputs"))
        pixels, floats = [], []
        finite = torch.ones((), dtype=torch.bool, device=latents.device)
        for chunk in self.vae.decode_chunks(latents[None], self.chunk_frames, finite=finite):  # [1, 3, t, H, W]
            pixels.append(frames_to_uint8(chunk, non_blocking=True)[0])  # no host wait per chunk on CUDA
            if debug:
                floats.append(((chunk[0] + 1) / 2).permute(1, 2, 3, 0).cpu())
        if latents.is_cuda:  # the chunks' pinned copies are queued, not done
            torch.cuda.current_stream(latents.device).synchronize()
        if not bool(finite):
            weights = self.vae.post_quant_conv.weight.dtype
            conv = self.vae.conv_dtype
            if conv is not None and conv != weights and self.vae.runs_channels_last(latents.device):
                # the narrower convolutions overflowed (a checkpoint's activations beyond float16's 65,504):
                # this request and every later one decode with convolutions in the weights' dtype
                logger.warning("Wan VAE: the decode's %s convolutions overflowed; decoding in %s from now on",
                               str(conv).removeprefix("torch."), str(weights).removeprefix("torch."))
                self.vae.conv_dtype = None
                return self._decode(latents, options)
            # convolutions already in the weights' dtype: a redo would give the same, so none is made
            logger.warning("Wan VAE: the decoded frames are not finite (%s convolutions; latents finite: %s)",
                           str(conv or weights).removeprefix("torch."), bool(torch.isfinite(latents).all()))
        video = torch.cat(pixels)
        modalities = options.get("modalities") or ["video"]
        out: dict[str, torch.Tensor] = {}
        if "video" in modalities:
            out["video"] = video
        if "image" in modalities and video.shape[0] == 1:
            out["image"] = video[0]
        if debug:
            out["frames"] = torch.cat(floats)
        if options.get("report_progress"):
            out["progress"] = torch.ones(1)
        return out
