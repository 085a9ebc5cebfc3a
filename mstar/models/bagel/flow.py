"""BAGEL's rectified flow: the shifted time grid, classifier-free guidance with renorm, and the Euler step.

Latents go from noise (t = 1) to an image (t = 0) over `num_timesteps` grid points: t = s * u / (1 + (s - 1) u)
for u evenly spaced from 1 to 0 (shift s), one Euler step x <- x - v * (t_i - t_{i+1}) per point but the
last. Guidance mixes up to three velocities (full context, without text, without the input image) at
the grid points inside the guidance interval (lo, hi], and rescales the guided velocity so its norm
(over the whole image, per token, or the text-guided part per token) does not exceed the full
context's, by at most the factor `renorm_min`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

RENORM_TYPES = ("global", "channel", "text_channel")


@dataclass(frozen=True)
class Guidance:
    """A request's guidance settings (the upstream inferencer's names in comments)."""

    text_scale: float = 4.0  # cfg_text_scale: full context against the one without the prompt
    image_scale: float = 1.5  # cfg_img_scale: against the context without the input image(s)
    interval: tuple[float, float] = (0.4, 1.0)  # cfg_interval: guided where lo < t <= hi
    renorm_type: str = "global"  # cfg_renorm_type
    renorm_min: float = 0.0  # cfg_renorm_min: the smallest rescale factor (1 turns renorm off)

    def active(self, t: float) -> bool:
        """Whether guidance applies at time t (the text scale gates the image scale too); compared in float32,
        the grid's precision, so a grid point equal to a bound falls on the same side as upstream's."""
        return self.text_scale > 1.0 and _f32(self.interval[0]) < _f32(t) <= _f32(self.interval[1])

    def image_active(self, t: float) -> bool:
        return self.active(t) and self.image_scale > 1.0


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def timesteps(num_timesteps: int, shift: float) -> torch.Tensor:
    """[num_timesteps] float32 grid from 1 to 0, shifted."""
    u = torch.linspace(1, 0, num_timesteps)
    return shift * u / (1 + (shift - 1) * u)


def guided_velocity(full: torch.Tensor, no_text: torch.Tensor | None, no_image: torch.Tensor | None,
                    guidance: Guidance) -> torch.Tensor:
    """The velocity [N, D] of one request from its branches' (no_text None: no guidance at this step;
    no_image None: no image guidance)."""
    if no_text is None:
        return full
    text_guided = no_text + guidance.text_scale * (full - no_text)
    if guidance.renorm_type == "text_channel":
        text_guided = text_guided * _renorm(full, text_guided, -1, guidance.renorm_min)
        return text_guided if no_image is None else no_image + guidance.image_scale * (text_guided - no_image)
    guided = text_guided if no_image is None else no_image + guidance.image_scale * (text_guided - no_image)
    dims = None if guidance.renorm_type == "global" else -1
    return guided * _renorm(full, guided, dims, guidance.renorm_min)


def _renorm(reference: torch.Tensor, guided: torch.Tensor, dim: int | None, low: float) -> torch.Tensor:
    if dim is None:
        ratio = torch.linalg.vector_norm(reference) / (torch.linalg.vector_norm(guided) + 1e-8)
    else:
        ratio = torch.linalg.vector_norm(reference, dim=dim, keepdim=True) / (
            torch.linalg.vector_norm(guided, dim=dim, keepdim=True) + 1e-8)
    return ratio.clamp(min=low, max=1.0)


def initial_noise(tokens: int, width: int, seed: int) -> torch.Tensor:
    """[tokens, width] float32 standard normal noise from the request's own CPU generator."""
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed))


def guidance_of(options: dict) -> Guidance:
    """A request's resolved guidance options (processor.resolve_options) as a `Guidance`."""
    lo, hi = options["cfg_interval"]
    return Guidance(float(options["guidance_scale"]), float(options["image_guidance_scale"]), (float(lo), float(hi)),
                    str(options["cfg_renorm_type"]), float(options["cfg_renorm_min"]))


def branch_needed(branch: str, options: dict) -> bool:
    """Whether a request keeps the context of guidance `branch` at all (image output with guidance; the
    no-image branch only when its context differs from the full one, else the full one stands in)."""
    if branch == "full":
        return True
    if not options.get("image_output"):
        return False
    guidance = guidance_of(options)
    if guidance.text_scale <= 1.0 or guidance.interval[0] >= guidance.interval[1]:
        return False
    return branch == "no_text" or (guidance.image_scale > 1.0 and bool(options.get("no_image_context")))


def branch_active(branch: str, t: float, options: dict) -> bool:
    """Whether `branch` predicts a velocity at time t (the full branch always does)."""
    if branch == "full":
        return True
    if not branch_needed(branch, options):
        return False
    guidance = guidance_of(options)
    return guidance.active(t) if branch == "no_text" else guidance.image_active(t)
