"""Request options of the image and video generators: the prompt, size, frame count, seed and bounded numbers.

`resolve_generation` resolves what every video generator takes (size, frames, fps, steps, guidance, seed)
against the deployment's `GenerationDefaults` within the model's `GenerationLimits`.

Each check raises ValueError naming the option, its value and what it must be, so the server answers 400
with the fix. The limits (size multiple, largest side, most frames) are the caller's: they depend on the
model's VAE and patches.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

# the request options `resolve_generation` reads
GENERATION_OPTIONS = frozenset({"size", "width", "height", "num_frames", "seconds", "fps", "num_inference_steps",
                                "guidance_scale", "seed"})


@dataclass(frozen=True)
class GenerationDefaults:
    """A video generator's request defaults that depend on the deployment (full size or tiny)."""

    width: int
    height: int
    num_frames: int
    fps: float
    num_inference_steps: int
    guidance_scale: float


@dataclass(frozen=True)
class GenerationLimits:
    """What a video generator accepts: they follow from its VAE and patches."""

    multiple: int  # each side a multiple of this
    max_side: int
    max_pixels: int  # width x height of one frame, the largest the model was trained at
    max_frames: int
    max_steps: int
    snap: bool = False  # round the sides of option `size` to the multiple instead of refusing them


def positive_bounds(config: Any, model: str) -> None:
    """A serve config's `max_pixels` and `max_frames`, where set, are positive."""
    for name in ("max_pixels", "max_frames"):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{model} model_kwargs.{name}={value!r} must be a positive integer (unset: as trained)")


def deployment_limits(limits: GenerationLimits, config: Any, defaults: GenerationDefaults) -> GenerationLimits:
    """`limits` with the serve config's `max_pixels` / `max_frames` where set (a deployment that wants more);
    ValueError when the deployment's own default size or frames fall outside them."""
    limits = replace(limits, max_pixels=config.max_pixels or limits.max_pixels,
                     max_frames=config.max_frames or limits.max_frames)
    if defaults.width * defaults.height > limits.max_pixels:
        raise ValueError(f"the default size {defaults.width}x{defaults.height} has more than max_pixels="
                         f"{limits.max_pixels}; raise model_kwargs.max_pixels or lower model_kwargs.width/height")
    if defaults.num_frames > limits.max_frames:
        raise ValueError(f"the default num_frames={defaults.num_frames} is more than max_frames={limits.max_frames}; "
                         "raise model_kwargs.max_frames or lower model_kwargs.num_frames")
    return limits


def resolve_generation(options: Mapping[str, Any], defaults: GenerationDefaults, limits: GenerationLimits,
                       sized: bool = True) -> dict[str, Any]:
    """A request's width, height, num_frames, fps, num_inference_steps, guidance_scale and seed; ValueError
    names a bad one. Without `sized` (the frames' size comes from elsewhere) width, height and frames are 0."""
    fps = number(options.get("fps", defaults.fps), "fps", 0.0, 240.0, exclusive_low=True)
    width = height = num_frames = 0
    if sized:
        width, height = video_size(options, defaults.width, defaults.height, limits.multiple, limits.max_side,
                                   snap=limits.snap)
        frame_pixels(width, height, limits.max_pixels)
        num_frames = frame_count(options, defaults.num_frames, fps, limits.max_frames)
        # a clip's seconds size Cosmos3's sound track and place its positions, so a tiny fps is refused
        longest = limits.max_frames / defaults.fps
        if num_frames / fps > longest:
            raise ValueError(f"{num_frames} frames at fps={fps:g} last {num_frames / fps:g} s, longer than the "
                             f"{longest:g} s this model makes ({limits.max_frames} frames at {defaults.fps:g} fps); "
                             "raise fps or ask for fewer frames")
    steps = options.get("num_inference_steps", defaults.num_inference_steps)
    return {"width": width, "height": height, "num_frames": num_frames, "fps": fps,
            "num_inference_steps": integer(steps, "num_inference_steps", 1, limits.max_steps),
            "guidance_scale": number(options.get("guidance_scale", defaults.guidance_scale), "guidance_scale", 0.0,
                                     100.0),
            "seed": seed(options)}


def request_text(request: Mapping[str, Any]) -> str | None:
    """The request's `text`, else the text parts of its `messages` joined by spaces; None when blank."""
    text = request.get("text")
    if text is None and request.get("messages"):
        parts = []
        for message in request["messages"]:
            content = message.get("content") or ""
            parts += [content] if isinstance(content, str) else [p.get("text", "") for p in content
                                                                  if p.get("type") == "text"]
        text = " ".join(parts)
    return text if isinstance(text, str) and text.strip() else None


def video_size(options: Mapping[str, Any], width: int, height: int, multiple: int, max_side: int,
               snap: bool = False) -> tuple[int, int]:
    """(width, height) from option `size` "WxH" or `width`/`height`, defaulting to `width` x `height`;
    each side a multiple of `multiple` in [multiple, max_side]. With `snap`, the sides of `size` (an OpenAI
    size such as "720x1280") are rounded to the nearest multiple instead of refused; the response then
    names the size produced."""
    size = options.get("size")
    if size not in (None, "auto"):
        try:
            width, height = (int(v) for v in str(size).lower().split("x"))
        except ValueError:
            raise ValueError(f"size={size!r} must look like 'WxH', e.g. '{width}x{height}'") from None
        if snap:
            width, height = (max(multiple, multiple * round(side / multiple)) for side in (width, height))
    else:
        width, height = options.get("width", width), options.get("height", height)
    for name, value in (("width", width), ("height", height)):
        value = integer(value, name, multiple, max_side)
        if value % multiple:
            raise ValueError(f"{name}={value} must be a multiple of {multiple}; try {multiple * round(value / multiple)}")
    return int(width), int(height)


def frame_pixels(width: int, height: int, max_pixels: int) -> None:
    """Refuse a frame of more than `max_pixels` (its tokens, and the VAE's memory, grow with them)."""
    if width * height > max_pixels:
        raise ValueError(f"size={width}x{height} has {width * height} pixels per frame, more than the {max_pixels} "
                         "this model takes; ask for a smaller size")


def frame_count(options: Mapping[str, Any], default: int, fps: float, max_frames: int) -> int:
    """Option `num_frames` (4k+1), or `seconds` at `fps` (not both), else 1 for an image-only request, else
    `default`."""
    modalities = list(options.get("modalities") or ["video"])
    num_frames = options.get("num_frames")
    if num_frames is not None and options.get("seconds") is not None:  # one would be ignored
        raise ValueError(f"seconds={options['seconds']!r} and num_frames={num_frames!r}: give one of them "
                         f"(seconds become frames at fps={fps:g})")
    if num_frames is None and options.get("seconds") is not None:
        seconds = number(options["seconds"], "seconds", 0.0, 600.0, exclusive_low=True)
        num_frames = 4 * max(round(seconds * fps / 4), 0) + 1
    if num_frames is None:
        num_frames = 1 if "image" in modalities and "video" not in modalities else default
    num_frames = integer(num_frames, "num_frames", 1, max_frames)
    if num_frames % 4 != 1:
        raise ValueError(f"num_frames={num_frames} must be 4k+1 (1, 5, 9, ...); try {4 * (num_frames // 4) + 1}")
    if "image" in modalities and "video" not in modalities and num_frames != 1:
        raise ValueError(f"an image output needs num_frames=1, got num_frames={num_frames}")
    return num_frames


def seed(options: Mapping[str, Any]) -> int:
    """Option `seed`, or one drawn at random when the request sets none."""
    value = options.get("seed")
    return secrets.randbelow(2**31) if value is None else integer(value, "seed", 0, 2**63 - 1)


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
