"""Toy request <-> tensors: text is UTF-8 bytes; media become a few statistic bytes; outputs become
str, numpy arrays and samples.

Media inputs (request["media"], already decoded by the server) are folded into the prompt as a short,
deterministic byte summary per item, so they change the encoder's context and hence the answer:
- image: mean R, G, B, then height and width modulo 256 (5 bytes);
- audio: 8 bytes, the mean absolute amplitude of 8 equal segments scaled to 0-255 (a "transcription"
  of an audio file is the text the toy generates from these bytes: deterministic in the samples);
- video: the frame count modulo 256, then the mean R, G, B of all frames (4 bytes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from mstar.models.base import Processor
from mstar.models.common.video_options import video_size

AUDIO_SEGMENTS = 8
MAX_PROMPT_BYTES = 1 << 20  # one token per byte: the toy's context


class ToyProcessor(Processor):
    """`{"text": str}` or chat `messages`, plus optional `media` -> prompt bytes; tokens decode to characters."""

    sample_rate = 8000  # of the vocoder's samples

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        text = request.get("text")
        if text is None and request.get("messages"):
            text = "\n".join(_message_text(m) for m in request["messages"])
        data = (text or "").encode("utf-8")
        if len(data) > MAX_PROMPT_BYTES:  # checked before the bytes become a list of ids
            raise ValueError(f"the toy's prompt is {len(data)} bytes, over its limit of {MAX_PROMPT_BYTES}")
        prompt = list(data)
        for item in request.get("media") or ():
            prompt += media_summary(item)
        if not prompt:
            raise ValueError("toy needs a non-empty text prompt or at least one media input")
        return {"prompt_ids": torch.tensor(prompt, dtype=torch.long)}

    def validate_options(self, options: Mapping[str, Any]) -> None:
        max_tokens = options.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if max_tokens > 1 << 20:
            raise ValueError(f"max_tokens={max_tokens} is above the toy's limit of {1 << 20}")
        painted_size(options, self.cfg.image_height)

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        tensor = tensor.cpu()
        if name == "text":
            return bytes(tensor.tolist()).decode("latin-1")
        return tensor.numpy()


def media_summary(item: Mapping[str, Any]) -> list[int]:
    """The statistic bytes (0-255) one decoded media item adds to the toy's prompt (see the module doc)."""
    kind, data = item.get("type"), np.asarray(item.get("data"))
    if kind == "image":
        if data.ndim != 3 or data.shape[-1] < 3:
            raise ValueError(f"toy image input must be (H, W, 3), got shape {data.shape}")
        means = data[..., :3].reshape(-1, 3).mean(axis=0)
        return [int(m) for m in means] + [data.shape[0] % 256, data.shape[1] % 256]
    if kind == "audio":
        samples = np.abs(data.astype(np.float64).reshape(-1))
        if samples.size == 0:
            raise ValueError("toy audio input has no samples")
        return [min(255, int(seg.mean() * 255)) if seg.size else 0
                for seg in np.array_split(samples, AUDIO_SEGMENTS)]
    if kind == "video":
        if data.ndim != 4 or data.shape[-1] < 3:
            raise ValueError(f"toy video input must be (T, H, W, 3), got shape {data.shape}")
        means = data[..., :3].reshape(-1, 3).mean(axis=0)
        return [data.shape[0] % 256] + [int(m) for m in means]
    raise ValueError(f"toy takes image, audio and video media, got type {kind!r}")


def painted_size(options: Mapping[str, Any], height: int) -> tuple[int, int] | None:
    """(width, height) that option `size` ("WxH") or `width`/`height` asks the painter for (each side in
    [1, 4096]), or None: one pixel per generated token, `height` rows. ValueError names a bad value."""
    if all(options.get(k) in (None, "auto") for k in ("size", "width", "height")):
        return None
    return video_size(options, int(options.get("max_tokens", 16)), height, 1, 4096)


def _message_text(message: Mapping[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, str):
        return content
    return " ".join(part.get("text", "") for part in content if part.get("type") == "text")
