"""Cosmos3 request options: defaults per deployment, checks, and what a request resolves to.

Generation options: `size` "WxH" or `width`/`height` (multiples of 16), `num_frames` (1 for an image;
or `seconds` at `fps`), `fps`, `num_inference_steps`, `guidance_scale` (1 turns guidance off),
`seed` (drawn at random when missing), `negative_prompt`. Policy options (modality "actions"):
`embodiment`, `chunk_size`, `resolution_tier`, `view_point`. A bad value raises ValueError naming it.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mstar.models.cosmos3.actions import RESOLUTION_TIERS, domain_of
from mstar.models.cosmos3.prompts import VIEWPOINTS

MULTIPLE = 16  # the VAE's spatial compression; odd latent sizes are padded to whole patches
MAX_SIDE = 4096
MAX_FRAMES = 1025
MAX_STEPS = 1000
MAX_CHUNK = 256


@dataclass(frozen=True)
class PolicyDefaults:
    """Defaults of a policy request (the DROID checkpoint's serving values for cosmos3_droid)."""

    embodiment: str = "droid_lerobot"
    chunk_size: int = 32
    resolution_tier: int = 480
    view_point: str = "ego_view"


@dataclass(frozen=True)
class Cosmos3Defaults:
    """Request defaults that depend on the deployment (full size or tiny, omni or policy)."""

    width: int = 1280
    height: int = 720
    num_frames: int = 189
    fps: float = 24.0
    num_inference_steps: int = 35
    guidance_scale: float = 6.0
    policy: PolicyDefaults = PolicyDefaults()


@dataclass(frozen=True)
class Generation:
    """What a generation request resolved to."""

    width: int
    height: int
    num_frames: int
    fps: float
    num_inference_steps: int
    guidance_scale: float
    seed: int

    def as_options(self) -> dict[str, Any]:
        return dict(vars(self))


def resolve_generation(options: Mapping[str, Any], defaults: Cosmos3Defaults, policy: bool) -> Generation:
    """The size, frames, rate, steps, guidance and seed of a request (a policy's size and frames come later)."""
    fps = number(options.get("fps", defaults.fps), "fps", 0.0, 240.0, exclusive_low=True)
    width, height = (0, 0) if policy else _size(options, defaults)
    num_frames = 0 if policy else _frames(options, defaults, fps)
    seed = options.get("seed")
    return Generation(
        width=width, height=height, num_frames=num_frames, fps=fps,
        num_inference_steps=integer(options.get("num_inference_steps", defaults.num_inference_steps),
                                    "num_inference_steps", 1, MAX_STEPS),
        guidance_scale=number(options.get("guidance_scale", defaults.guidance_scale), "guidance_scale", 0.0, 100.0),
        seed=secrets.randbelow(2**31) if seed is None else integer(seed, "seed", 0, 2**63 - 1))


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


def _frames(options: Mapping[str, Any], defaults: Cosmos3Defaults, fps: float) -> int:
    modalities = list(options.get("modalities") or ["video"])
    num_frames = options.get("num_frames")
    if num_frames is None and options.get("seconds") is not None:
        seconds = number(options["seconds"], "seconds", 0.0, 600.0, exclusive_low=True)
        num_frames = 4 * max(round(seconds * fps / 4), 0) + 1
    if num_frames is None:
        num_frames = 1 if "image" in modalities and "video" not in modalities else defaults.num_frames
    num_frames = integer(num_frames, "num_frames", 1, MAX_FRAMES)
    if num_frames % 4 != 1:
        raise ValueError(f"num_frames={num_frames} must be 4k+1 (1, 5, 9, ..., 189); try {4 * (num_frames // 4) + 1}")
    if "image" in modalities and "video" not in modalities and num_frames != 1:
        raise ValueError(f"an image output needs num_frames=1, got num_frames={num_frames}")
    return num_frames


def _size(options: Mapping[str, Any], defaults: Cosmos3Defaults) -> tuple[int, int]:
    size = options.get("size")
    if size not in (None, "auto"):
        try:
            width, height = (int(v) for v in str(size).lower().split("x"))
        except ValueError:
            raise ValueError(f"size={size!r} must look like 'WxH', e.g. '1280x720'") from None
    else:
        width, height = options.get("width", defaults.width), options.get("height", defaults.height)
    for name, value in (("width", width), ("height", height)):
        value = integer(value, name, MULTIPLE, MAX_SIDE)
        if value % MULTIPLE:
            raise ValueError(f"{name}={value} must be a multiple of {MULTIPLE}; try {MULTIPLE * round(value / MULTIPLE)}")
    return int(width), int(height)


def integer(value: Any, name: str, low: int, high: int) -> int:
    """`value` as an int in [low, high]; ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return int(value)


def number(value: Any, name: str, low: float, high: float, exclusive_low: bool = False) -> float:
    """`value` as a float in [low, high] (low excluded when asked); ValueError naming `name` otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (low < value if exclusive_low else low <= value) or value > high:
        bound = f"({low}, {high}]" if exclusive_low else f"[{low}, {high}]"
        raise ValueError(f"{name} must be a number in {bound}, got {value!r}")
    return float(value)
