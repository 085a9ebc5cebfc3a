"""The served `audio_encoder` and `vision_encoder` components (stateless, in the thinker lane).

Both run in walk `prefill_media` before the thinker. Each encodes the media of every request of its
batch in one packed call, then places its rows into the request's multimodal rows: `mm_embeds`
[m, H] and `deepstack_embeds` [m, num_deepstack, H] (zero for audio rows), m = the prompt's
placeholder rows in order, `mm_kinds` [m] telling which rows are whose (see `media_inputs`). The
first encoder with work for a request allocates the two tensors; a request without media of an
encoder's kind passes through it unchanged (empty outputs).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mstar.engines.base import StatelessBase
from mstar.models.qwen3_omni.audio_encoder import AudioEncoder, audio_output_lengths
from mstar.models.qwen3_omni.media_inputs import MM_AUDIO, MM_VISION
from mstar.models.qwen3_omni.vision_encoder import VisionEncoder

logger = logging.getLogger(__name__)


def place_rows(x: Mapping[str, torch.Tensor], kind: int, rows: torch.Tensor, deepstack: torch.Tensor | None,
               num_deepstack: int) -> dict[str, torch.Tensor]:
    """`mm_embeds` / `deepstack_embeds` of one request with the placeholder rows of `kind` filled by
    `rows` [k, H] (and `deepstack` [k, num_deepstack, H] when given); ValueError on a count mismatch."""
    kinds = x["mm_kinds"].reshape(-1)
    embeds, stack = x.get("mm_embeds"), x.get("deepstack_embeds")
    if embeds is None or stack is None:
        embeds = rows.new_zeros(kinds.numel(), rows.shape[-1])
        stack = rows.new_zeros(kinds.numel(), num_deepstack, rows.shape[-1])
    where = torch.nonzero(kinds == kind).squeeze(1)
    if where.numel() != rows.shape[0]:
        raise ValueError(f"the prompt has {where.numel()} placeholder rows for the encoder's {rows.shape[0]} "
                         "rows; the processor's placeholder expansion and the encoder disagree")
    embeds = embeds.index_copy(0, where, rows.to(embeds.dtype))
    if deepstack is not None:
        stack = stack.index_copy(0, where, deepstack.to(stack.dtype))
    return {"mm_embeds": embeds, "deepstack_embeds": stack}


class _MediaEncoder(StatelessBase, nn.Module):
    """Encodes the requests of a batch that carry input `media_input` in one call (`encode`); the others
    pass through with empty outputs."""

    media_input: str

    @torch.no_grad()
    def run_batch(self, walk: str, node: str, inputs: Sequence[Mapping[str, torch.Tensor]],
                  options: Sequence[Mapping[str, Any]]) -> list[dict[str, torch.Tensor]]:
        todo = [i for i, x in enumerate(inputs) if self.media_input in x]
        out: list[dict[str, torch.Tensor]] = [{} for _ in inputs]
        if todo:
            for i, placed in zip(todo, self.encode([inputs[i] for i in todo]), strict=True):
                out[i] = placed
        return out

    def encode(self, inputs: list[Mapping[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """`mm_embeds` / `deepstack_embeds` of each request (all carry the media), in order."""
        raise NotImplementedError


class BatchedAudioEncoder(_MediaEncoder):
    """`audio_encoder`: inputs `audio_features` [mel, frames], `audio_lengths` [audios], `mm_kinds`
    (and the rows an earlier encoder placed); outputs `mm_embeds`, `deepstack_embeds`.

    The requests' audios run as one packed batch whose chunk padding stays per request (the
    encoder's `group_sizes`), so each request gets exactly what it would get alone.
    """

    media_input = "audio_features"

    def __init__(self, encoder: AudioEncoder, num_deepstack: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.num_deepstack = num_deepstack

    def encode(self, inputs: list[Mapping[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        lengths = [x["audio_lengths"].reshape(-1).tolist() for x in inputs]
        features = torch.cat([x["audio_features"] for x in inputs], dim=1)
        embeds = self.encoder(features, [n for group in lengths for n in group], [len(g) for g in lengths])
        sizes = [sum(audio_output_lengths(group, self.encoder.config)) for group in lengths]
        return [place_rows(x, MM_AUDIO, rows, None, self.num_deepstack)
                for x, rows in zip(inputs, embeds.split(sizes))]


class BatchedVisionEncoder(_MediaEncoder):
    """`vision_encoder`: inputs `pixel_values` [patches, patch_dim], `vision_grid_thw` [items, 3],
    `mm_kinds` (and the rows an earlier encoder placed); outputs `mm_embeds`, `deepstack_embeds`.

    Every image and video frame attends only to itself, so packing the requests' items into one
    call changes no request's result.
    """

    media_input = "pixel_values"

    def __init__(self, encoder: VisionEncoder) -> None:
        super().__init__()
        self.encoder = encoder
        self.num_deepstack = len(encoder.config.deepstack_visual_indexes)

    def encode(self, inputs: list[Mapping[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        grids = [x["vision_grid_thw"].reshape(-1, 3) for x in inputs]
        pixels = torch.cat([x["pixel_values"] for x in inputs])
        result = self.encoder(pixels, torch.cat(grids))
        merge = self.encoder.config.spatial_merge_size ** 2
        sizes = [int(g.prod(dim=1).sum()) // merge for g in grids]
        embeds = result.embeds
        deepstack = (torch.stack(result.deepstack, dim=1) if result.deepstack
                     else embeds.new_zeros(embeds.shape[0], 0, embeds.shape[1]))
        return [place_rows(x, MM_VISION, rows, stack, self.num_deepstack)
                for x, rows, stack in zip(inputs, embeds.split(sizes), deepstack.split(sizes))]
