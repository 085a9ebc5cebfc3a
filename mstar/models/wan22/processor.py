"""Wan2.2 requests <-> tensors: prompts to token ids, a reference image to pixels, options resolved.

Options (each request may set any): `size` "WxH" (each side rounded to a multiple of 32, so OpenAI's
"720x1280" gives 704x1280) or `width`/`height` (multiples of 32), `num_frames`
(4k+1; or `seconds` at `fps`; 1 when only an image is asked for), `fps`, `guidance_scale`,
`num_inference_steps`, `seed` (drawn at random when missing), `negative_prompt`. A request with an
image in its media is image-to-video: the image (resized to the video size) becomes frame 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mstar.models.base import Processor
from mstar.models.common.video_options import (
    GenerationDefaults,
    GenerationLimits,
    deployment_limits,
    request_text,
    resolve_generation,
)

# Sides a multiple of 32: the VAE's 16x spatial compression times the DiT's 2x2 patches. TI2V-5B was trained
# at 1280x704 (either way round) and 121 frames; a bigger frame or a longer clip only holds a worker longer.
LIMITS = GenerationLimits(multiple=32, max_side=4096, max_pixels=1280 * 704, max_frames=121, max_steps=200, snap=True)


@dataclass(frozen=True)
class Wan22Defaults(GenerationDefaults):
    """Request defaults that depend on the deployment (full size or tiny)."""

    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    limits: GenerationLimits = LIMITS


def defaults_for(config: Any) -> Wan22Defaults:
    """The defaults of a Wan22ServeConfig: 1280x704x121 at full size, 64x64x5 when tiny."""
    width, height, frames = (64, 64, 5) if config.tiny else (1280, 704, 121)
    defaults = Wan22Defaults(config.width or width, config.height or height, config.num_frames or frames, config.fps)
    return replace(defaults, limits=deployment_limits(LIMITS, config, defaults))


def resolve_options(options: Mapping[str, Any], defaults: Wan22Defaults) -> dict[str, Any]:
    """The resolved size, frames, fps, steps, guidance and seed of a request; ValueError names a bad one."""
    return resolve_generation(options, defaults, defaults.limits)


class Wan22Processor(Processor):
    """`{"text": prompt, "media": [optional reference image]}` -> token ids (and pixels); frames out."""

    def __init__(self, tokenizer_folder: str | Path, text_length: int, defaults: Wan22Defaults) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(tokenizer_folder) / "tokenizer.json"))
        pad = self.tokenizer.token_to_id("<pad>")
        self.pad_id = 0 if pad is None else pad
        self.text_length, self.defaults = text_length, defaults

    def validate_options(self, options: Mapping[str, Any]) -> None:
        resolve_options(options, self.defaults)

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Token ids and masks of the prompt (and, under guidance, the negative prompt); the reference
        image as [3, 1, H, W] in [-1, 1]. Writes the resolved options (and `image_to_video`) into `options`."""
        from mstar.models.wan22.text_encoder import tokenize_prompts

        options.update(resolve_options(options, self.defaults))
        prompt = request_text(request)
        if prompt is None:
            raise ValueError("wan22 needs a non-empty text prompt")
        negative = options.get("negative_prompt") or ""
        if not isinstance(negative, str):
            raise ValueError(f"negative_prompt must be a string, got {type(negative).__name__}")
        guided = options["guidance_scale"] > 1.0  # as the reference: no unconditional branch at or below 1
        ids, mask = tokenize_prompts(self.tokenizer, [prompt, negative] if guided else [prompt], self.pad_id,
                                     self.text_length)
        out = {"prompt_ids": ids[0], "prompt_mask": mask[0]}
        if guided:
            out.update(negative_ids=ids[1], negative_mask=mask[1])
        image = _reference_image(request)
        options["image_to_video"] = image is not None
        if image is not None:
            out["image"] = image_tensor(image, options["width"], options["height"])
        return out

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        if name == "progress":
            return float(tensor.reshape(-1)[0])
        return tensor.detach().cpu().numpy()


def image_tensor(image: np.ndarray, width: int, height: int) -> torch.Tensor:
    """uint8 [H, W, 3|4] -> float32 [3, 1, height, width] in [-1, 1], resized (Lanczos) as the reference does."""
    from PIL import Image

    array = np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] not in (3, 4):
        raise ValueError(f"the reference image must be uint8 [H, W, 3], got {array.dtype} {array.shape}")
    pil = Image.fromarray(array).convert("RGB")
    if pil.size != (width, height):
        pil = pil.resize((width, height), resample=Image.Resampling.LANCZOS)
    pixels = torch.from_numpy(np.asarray(pil, dtype=np.float32) / 255.0)
    return (pixels * 2 - 1).permute(2, 0, 1).unsqueeze(1).contiguous()


def _reference_image(request: Mapping[str, Any]) -> np.ndarray | None:
    media = request.get("media") or []
    if any(m.get("type") not in ("image",) for m in media):
        kinds = sorted({str(m.get("type")) for m in media})
        raise ValueError(f"wan22 takes at most one reference image; got media of types {kinds}")
    images = [m for m in media if m.get("name") != "mask"]
    if len(images) > 1:
        raise ValueError(f"wan22 takes one reference image, got {len(images)}")
    return images[0]["data"] if images else None
