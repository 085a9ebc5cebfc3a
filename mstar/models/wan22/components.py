"""The stateless components of Wan2.2 as the stateless engine runs them: text encoder and DiT.

Edges carry one request's tensors without a batch dimension: embeddings [L, D], latents [C, F', H', W'],
per-frame timesteps [F']. The guidance scheduler (per-request state) is in combine.py, the VAE component
in `models/common/wan_vae/component.py`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from mstar.engines.base import StatelessBase
from mstar.models.common.guidance import run_live_branches
from mstar.models.wan22.text_cache import TextKVCache
from mstar.models.wan22.text_encoder import UMT5Encoder
from mstar.models.wan22.transformer import WanTransformer


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
        return run_live_branches(items, "context", self._velocities)

    def _velocities(self, items: list[Any]) -> list[dict]:
        dtype = self.transformer.proj_out.weight.dtype
        latents = torch.stack([item.inputs["latents"] for item in items]).to(dtype)
        timesteps = torch.stack([item.inputs["timestep"] for item in items])
        text_kv = self._text_kv(items, dtype)
        velocity = self.transformer(latents, timesteps, None, sp_group=self.sp_group, text_kv=text_kv).float()
        return [{"velocity": v} for v in velocity]

    def _text_kv(self, items: list[Any], dtype: torch.dtype) -> list:
        """The batch's cross-attention (k, v) per block: cached from an earlier step of the same rows."""
        keys = [(item.request_id, item.node) for item in items]
        texts = [item.inputs["context"] for item in items]
        text_kv = self.text_cache.get(keys, texts)
        if text_kv is None:
            text_kv = self.transformer.text_states(torch.stack(texts).to(dtype))
            self.text_cache.put(keys, texts, text_kv)
        return text_kv
