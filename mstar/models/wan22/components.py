"""The stateless components of Wan2.2 as the stateless engine runs them: text encoder, DiT and VAE.

Edges carry one request's tensors without a batch dimension: embeddings [L, D], latents [C, F', H', W'],
per-frame timesteps [F'], frames [T, H, W, 3]. The guidance scheduler (per-request state) is in
combine.py.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from mstar.engines.base import StatelessBase
from mstar.models.wan22.text_cache import TextKVCache
from mstar.models.wan22.text_encoder import UMT5Encoder
from mstar.models.wan22.transformer import WanTransformer
from mstar.models.wan22.vae import WanVAE, frames_to_uint8

logger = logging.getLogger(__name__)


class TextEncoderComponent(StatelessBase, nn.Module):
    """(prompt_ids, prompt_mask[, negative_ids, negative_mask]) [L] -> prompt_embeds[, negative_embeds] [L, D].

    Every prompt and negative prompt of the batch goes through the encoder in one forward.
    """

    def __init__(self, encoder: UMT5Encoder, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.encoder = encoder
        self.out_dtype = out_dtype  # the DiT's dtype: embeddings are made once, read every step

    @torch.no_grad()
    def run_batch(self, walk: str, node: str, inputs: list[dict], options: list[dict]) -> list[dict]:
        ids = [x["prompt_ids"] for x in inputs] + [x["negative_ids"] for x in inputs if "negative_ids" in x]
        masks = [x["prompt_mask"] for x in inputs] + [x["negative_mask"] for x in inputs if "negative_ids" in x]
        states = self.encoder(torch.stack(ids), torch.stack(masks)).to(self.out_dtype)
        out, negatives = [], iter(states[len(inputs):])
        for row, x in enumerate(inputs):
            item = {"prompt_embeds": states[row]}
            if "negative_ids" in x:
                item["negative_embeds"] = next(negatives)
            out.append(item)
        return out


class DiTComponent(StatelessBase, nn.Module):
    """(latents [C, F', H', W'], timestep [F'], context [L, D]) -> velocity [C, F', H', W'] float32.

    Items whose latent shapes match share one forward whatever their node (guidance branch), step or
    request. An item without `context` (the unconditional branch of a request without guidance)
    produces nothing.
    """

    def __init__(self, transformer: WanTransformer, text_cache_rows: int = 16) -> None:
        super().__init__()
        self.transformer = transformer
        self.sp_group: Any = None  # a sequence-parallel replica's torch.distributed group
        # cross-attention K/V of each request's text, reused across its steps (text_cache.py)
        self.text_cache = TextKVCache(text_cache_rows)

    def release(self, request_id: str) -> None:
        """Forget the request's cached text keys and values (safe for unknown ids)."""
        self.text_cache.release(request_id)

    def set_sp_group(self, group: Any) -> None:
        """Run every forward sequence-parallel over `group` (all its ranks make the same calls)."""
        self.sp_group = group

    def batch_key(self, item: Any) -> Hashable:
        """Items that may share a forward: same walk and latent shape; skipped branches together."""
        if "context" not in item.inputs:
            return (item.walk, "skip")
        return (item.walk, tuple(item.inputs["latents"].shape))

    @torch.no_grad()
    def run_items(self, items: list[Any]) -> list[dict]:
        out: list[dict] = [{} for _ in items]
        rows = [i for i, item in enumerate(items) if "context" in item.inputs]
        if not rows:
            return out
        dtype = self.transformer.proj_out.weight.dtype
        latents = torch.stack([items[i].inputs["latents"] for i in rows]).to(dtype)
        timesteps = torch.stack([items[i].inputs["timestep"] for i in rows])
        text_kv = self._text_kv([items[i] for i in rows], dtype)
        velocity = self.transformer(latents, timesteps, None, sp_group=self.sp_group, text_kv=text_kv).float()
        for row, i in enumerate(rows):
            out[i] = {"velocity": velocity[row]}
        return out

    def _text_kv(self, items: list[Any], dtype: torch.dtype) -> list:
        """The batch's cross-attention (k, v) per block: cached from an earlier step of the same rows."""
        keys = [(item.request_id, item.node) for item in items]
        texts = [item.inputs["context"] for item in items]
        text_kv = self.text_cache.get(keys, texts)
        if text_kv is None:
            text_kv = self.transformer.text_states(torch.stack(texts).to(dtype))
            self.text_cache.put(keys, texts, text_kv)
        return text_kv


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
                logger.warning("wan22 VAE: the decode's %s convolutions overflowed; decoding in %s from now on",
                               str(conv).removeprefix("torch."), str(weights).removeprefix("torch."))
                self.vae.conv_dtype = None
                return self._decode(latents, options)
            # convolutions already in the weights' dtype: a redo would give the same, so none is made
            logger.warning("wan22 VAE: the decoded frames are not finite (%s convolutions; latents finite: %s)",
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
