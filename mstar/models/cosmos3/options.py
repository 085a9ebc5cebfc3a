"""Cosmos3 request options: defaults per deployment, checks, and what a request resolves to.

Generation options: `size` "WxH" or `width`/`height` (multiples of 16), `num_frames` (1 for an image;
or `seconds` at `fps`), `fps`, `num_inference_steps`, `guidance_scale` (1 turns guidance off),
`seed` (drawn at random when missing), `negative_prompt`. Policy options (modality "actions"):
`embodiment`, `chunk_size`, `resolution_tier`, `view_point`. A bad value raises ValueError naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstar.models.common import video_options
from mstar.models.common.video_options import GenerationDefaults, GenerationLimits, integer
from mstar.models.cosmos3.actions import RESOLUTION_TIERS, domain_of
from mstar.models.cosmos3.prompts import VIEWPOINTS

# Sides a multiple of 16, the VAE's spatial compression: odd latent sizes are padded to whole patches. Frames
# at most the 720p tier's 1280x720 pixels (actions.RESOLUTION_TIERS) and clips at most the default 189 frames.
LIMITS = GenerationLimits(multiple=16, max_side=4096, max_pixels=1280 * 720, max_frames=189, max_steps=200)
MAX_CHUNK = 256


@dataclass(frozen=True)
class PolicyDefaults:
    """Defaults of a policy request (the DROID checkpoint's serving values for cosmos3_droid)."""

    embodiment: str = "droid_lerobot"
    chunk_size: int = 32
    resolution_tier: int = 480
    view_point: str = "ego_view"


@dataclass(frozen=True)
class Cosmos3Defaults(GenerationDefaults):
    """Request defaults that depend on the deployment (full size or tiny, omni or policy)."""

    policy: PolicyDefaults = PolicyDefaults()
    limits: GenerationLimits = LIMITS


@dataclass(frozen=True)
class Generation(GenerationDefaults):
    """What a generation request resolved to: its own values where it set them, else the defaults."""

    seed: int

    def as_options(self) -> dict[str, Any]:
        return dict(vars(self))


def resolve_generation(options: Mapping[str, Any], defaults: Cosmos3Defaults, policy: bool) -> Generation:
    """The size, frames, rate, steps, guidance and seed of a request (a policy's size and frames come later)."""
    return Generation(**video_options.resolve_generation(options, defaults, defaults.limits, sized=not policy))


@dataclass(frozen=True)
class Policy:
    """What a policy request resolved to."""

    embodiment: str
    domain: int
    action_width: int
    chunk_size: int
    resolution_tier: int
    view_point: str


def resolve_policy(options: Mapping[str, Any], defaults: PolicyDefaults) -> Policy:
    """The embodiment (domain id, action width), chunk size, resolution tier and view point of a request."""
    embodiment = options.get("embodiment", defaults.embodiment)
    if not isinstance(embodiment, str):
        raise ValueError(f"embodiment must be a string, got {embodiment!r}")
    domain, width = domain_of(embodiment)
    tier = integer(options.get("resolution_tier", defaults.resolution_tier), "resolution_tier", 1, 4096)
    if tier not in RESOLUTION_TIERS:
        raise ValueError(f"resolution_tier={tier} must be one of {sorted(RESOLUTION_TIERS)}")
    view = options.get("view_point", defaults.view_point)
    if view not in VIEWPOINTS:
        raise ValueError(f"view_point={view!r} must be one of {sorted(VIEWPOINTS)}")
    return Policy(embodiment, domain, width, integer(options.get("chunk_size", defaults.chunk_size), "chunk_size", 1,
                                                      MAX_CHUNK), tier, view)
