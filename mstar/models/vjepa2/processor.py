"""V-JEPA 2 requests <-> tensors: frames to normalised pixels, robot states and actions checked, options
resolved; latents, logits and actions out.

A request's frames come from one video (a file or data URL) or from image parts in order; an image
part named "goal" is the goal of a plan instead. Frames are resized so the shorter side is
crop * 256 / 224, center-cropped to crop x crop and normalised with ImageNet's mean and std, as the
checkpoints' video processor does.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mstar.models.base import Processor

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
MAX_FRAMES = 256
TASKS = ("encode", "rollout", "plan")
TASK_OUTPUTS = {"encode": {"latents"}, "rollout": {"predicted", "predicted_states"},
                "plan": {"actions", "energy", "progress"}}  # what each task's last walk sends


def pixels(frames: np.ndarray, crop: int) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> float32 [T, 3, crop, crop]: resized, center-cropped, normalised."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float() / 255.0
    height, width = video.shape[-2:]
    short = int(crop * 256 / 224)
    size = (short, max(short, round(width * short / height))) if height <= width else \
        (max(short, round(height * short / width)), short)
    video = F.interpolate(video, size=size, mode="bilinear", antialias=True, align_corners=False)
    top, left = (size[0] - crop) // 2, (size[1] - crop) // 2
    video = video[:, :, top:top + crop, left:left + crop]
    return (video - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]


def media_frames(request: Mapping[str, Any]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(frames [T, H, W, 3] or None, goal image [H, W, 3] or None) of a request (module docstring)."""
    media = list(request.get("media") or [])
    goals = [m for m in media if m.get("type") == "image" and m.get("name") == "goal"]
    videos = [m for m in media if m.get("type") == "video"]
    images = [m for m in media if m.get("type") == "image" and m.get("name") != "goal"]
    if other := sorted({str(m.get("type")) for m in media} - {"image", "video"}):
        raise ValueError(f"V-JEPA 2 reads video and images, not {other}")
    if len(goals) > 1 or len(videos) > 1 or (videos and images):
        raise ValueError("send one video or image frames (not both), and at most one image named 'goal'")
    frames = None
    if videos:
        frames = np.asarray(videos[0]["data"])
    elif images:
        shapes = {np.asarray(m["data"]).shape for m in images}
        if len(shapes) > 1:
            raise ValueError(f"image frames must share one size, got {sorted(shapes)}")
        frames = np.stack([_rgb(np.asarray(m["data"])) for m in images])
    if frames is not None:
        frames = np.stack([_rgb(f) for f in frames]) if frames.shape[-1] == 4 else frames
    return frames, (_rgb(np.asarray(goals[0]["data"])) if goals else None)


def _rgb(image: np.ndarray) -> np.ndarray:
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] not in (3, 4):
        raise ValueError(f"frames must be uint8 [H, W, 3], got {image.dtype} {image.shape}")
    return image[..., :3]


def matrix(value: Any, name: str, columns: int, rows: int | None = None) -> torch.Tensor:
    """A list of `rows` (any number when None) lists of `columns` finite numbers -> float32 [rows, columns]."""
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of lists of {columns} numbers") from None
    if array.ndim != 2 or array.shape[1] != columns or (rows is not None and array.shape[0] != rows):
        want = f"[{rows if rows is not None else 'n'}, {columns}]"
        raise ValueError(f"{name} must have shape {want}, got {list(array.shape)}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name} holds a value that is not a finite number")
    return torch.from_numpy(array).float()


def integer(options: Mapping[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def number(options: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ClipShape:
    """What a deployment's encoder takes."""

    crop: int  # pixels per side
    frames_per_clip: int  # frames a clip is sampled down to at most
    labels: tuple[str, ...] = ()  # the classifier's labels; empty: no classifier head


def sample_frames(frames: np.ndarray, count: int) -> np.ndarray:
    """`count` frames spread evenly over the clip (all of them when it is not longer)."""
    if len(frames) <= count:
        return frames
    return frames[np.linspace(0, len(frames) - 1, count).round().astype(int)]


class VJEPA2Processor(Processor):
    """`{"media": [video or frames]}` -> `video` [T, 3, crop, crop]; outputs: `latents` [N, D], `pooled`
    [D], `logits` [labels], `label` (text) — the ones a request lists (`modalities`) are made."""

    def __init__(self, shape: ClipShape) -> None:
        self.shape = shape

    def validate_options(self, options: Mapping[str, Any]) -> None:
        integer(options, "num_frames", self.shape.frames_per_clip, 1, MAX_FRAMES)
        wanted = set(options.get("modalities") or ["latents"])
        if wanted & {"logits", "label"} and not self.shape.labels:
            raise ValueError("this checkpoint has no classifier head; ask for latents or pooled")

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        self.validate_options(options)
        frames, goal = media_frames(request)
        if frames is None or goal is not None:
            raise ValueError("vjepa2 needs a video (or image frames) and takes no goal image")
        count = integer(options, "num_frames", self.shape.frames_per_clip, 1, MAX_FRAMES)
        options["classify"] = bool(set(options.get("modalities") or ["latents"]) & {"logits", "label"})
        return {"video": pixels(sample_frames(frames, count), self.shape.crop)}

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        if name == "label":
            return self.shape.labels[int(tensor.reshape(-1)[0])]
        return tensor.detach().float().cpu().numpy()


@dataclass(frozen=True)
class PlanDefaults:
    """The cross-entropy search's request defaults."""

    horizon: int = 2
    samples: int = 400
    topk: int = 10
    cem_iterations: int = 10
    maxnorm: float = 0.05


class VJEPA2ACProcessor(Processor):
    """Frames (each a context frame), optional goal image, robot `states` and `actions` (options) ->
    `frames` [C, 3, crop, crop], `goal` [3, crop, crop], `states` [C, 7], `actions` [K, 7].

    The task (option `task`, else inferred: a goal image plans, actions or asking for `predicted` roll out, else
    encode; asking for an output of another task is refused):
    - encode: `latents` [C, HW, E] (normalised per frame);
    - rollout: `actions` holds one action per context frame and one per further step (K = C + H - 1);
      outputs `predicted` [H, HW, E] and `predicted_states` [H, 7];
    - plan: `actions` holds the C - 1 actions between context frames; outputs `actions` [H, 7] (or the
      first [1, 7] unless `return_sequence`) and `energy` per search iteration.
    """

    def __init__(self, shape: ClipShape, action_dim: int, plan: PlanDefaults, max_context: int = 16) -> None:
        self.shape, self.action_dim, self.plan, self.max_context = shape, action_dim, plan, max_context

    def validate_options(self, options: Mapping[str, Any]) -> None:
        task = options.get("task")
        if task is not None and task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
        self._search(options)

    def _search(self, options: Mapping[str, Any]) -> dict[str, Any]:
        p = self.plan
        samples = integer(options, "samples", p.samples, 2, 65536)
        return {"horizon": integer(options, "horizon", p.horizon, 1, 64), "samples": samples,
                "topk": integer(options, "topk", min(p.topk, samples), 2, samples),
                "cem_iterations": integer(options, "cem_iterations", p.cem_iterations, 1, 1000),
                "maxnorm": number(options, "maxnorm", p.maxnorm, 0.0, 10.0)}

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        frames, goal = media_frames(request)
        if frames is None:
            raise ValueError("vjepa2_ac needs context frames: a video or image parts")
        if len(frames) > self.max_context:
            raise ValueError(f"{len(frames)} context frames; at most {self.max_context} (send the latest ones)")
        context = len(frames)
        wanted = set(options.get("modalities") or ["latents"])
        task = options.get("task") or ("plan" if goal is not None else
                                       "rollout" if options.get("actions") or wanted & TASK_OUTPUTS["rollout"]
                                       else "encode")
        self.validate_options({**options, "task": task})
        out = {"frames": pixels(frames, self.shape.crop)}
        if task != "encode":
            out["states"] = matrix(options.get("states"), "states", self.action_dim, context)
        if task == "rollout":
            actions = matrix(options.get("actions"), "actions", self.action_dim)
            horizon = len(actions) - context + 1
            if horizon < 1:
                raise ValueError(f"a rollout from {context} context frames needs at least {context} actions "
                                 f"(one per context frame, then one per further step), got {len(actions)}")
            if "horizon" in options and options["horizon"] != horizon:
                raise ValueError(f"horizon={options['horizon']!r} but {len(actions)} actions from {context} "
                                 f"context frames roll out {horizon} steps")
            options["horizon"] = horizon
            out["actions"] = actions
        if task == "plan":
            if goal is None:
                raise ValueError("a plan needs a goal image: an image part named 'goal'")
            options.update(self._search(options))
            seed = options.get("seed")
            options["seed"] = secrets.randbelow(2**31) if seed is None else integer(options, "seed", 0, 0, 2**63 - 1)
            out["goal"] = pixels(goal[None], self.shape.crop)[0]
            if context > 1:  # the actions between the context frames
                out["history"] = matrix(options.get("actions"), "actions", self.action_dim, context - 1)
        for name in sorted(wanted - TASK_OUTPUTS[task] - {"latents"}):  # every task encodes first
            owner = next((t for t, names in TASK_OUTPUTS.items() if name in names), None)
            raise ValueError(f"output {name!r} comes from task {owner}, and this request's task is {task!r}")
        options["task"] = task
        return out

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        if name == "progress":
            return float(tensor.reshape(-1)[0])
        return tensor.detach().float().cpu().numpy()


def first_or_all(actions: torch.Tensor, options: Mapping[str, Any]) -> torch.Tensor:
    """The whole plan [H, A] with option `return_sequence`, else its first action [1, A]."""
    return actions if options.get("return_sequence") else actions[:1]
