"""Pi0.5 requests <-> tensors: camera images, the robot's state and the task in; the action chunk out.

A request holds the task as its text, one image per camera (media parts named by camera, or unnamed ones
taken in the policy's camera order; a camera left out is masked, as lerobot does), and the state as
option `state` (the robot's `state_dim` numbers). Images are scaled to fit the policy's square input,
padded with black around the centre (openpi's resize_with_pad) and mapped to [-1, 1]; images already at
that size go out as uint8 pixels, mapped on the vision component's device (`unit_pixels`). The state is
normalised with the checkpoint's quantiles and written into the prompt (`prompt.py`); the chunk's first
`action_dim` entries are unnormalised on the way out. The flow starts from seeded noise (option `seed`).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mstar.models.base import Processor
from mstar.models.pi05.prompt import Quantiles, prompt_text

MAX_STEPS = 100
# every request option (Pi05.accepted_options); others are refused here too, since the openpi websocket
# reaches the processor without /generate's name check
OPTIONS = ("state", "num_steps", "seed", "modalities")


@dataclass(frozen=True)
class RobotSpec:
    """What a deployment's policy takes and gives."""

    cameras: tuple[str, ...]
    image_size: int
    state_dim: int
    action_dim: int
    chunk_size: int
    max_state_dim: int
    max_action_dim: int
    num_steps: int
    max_prompt_tokens: int
    state_stats: Quantiles = field(default_factory=Quantiles)
    action_stats: Quantiles = field(default_factory=Quantiles)


def pixels(image: np.ndarray, size: int) -> torch.Tensor:
    """uint8 [H, W, 3] -> float32 [3, size, size] in [-1, 1]: scaled to fit, black bars centred."""
    return unit_pixels(camera_pixels([image], size), pixel_values())[0]


def pixel_values() -> torch.Tensor:
    """float32 [256]: each uint8 value in [-1, 1] as openpi maps pixels, (x / 255) * 2 - 1 in float32 ops
    on the host (a CUDA division by a scalar multiplies by its reciprocal instead: other values)."""
    return torch.arange(256, dtype=torch.float32).div_(255.0).mul_(2.0).sub_(1.0)


def unit_pixels(images: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Camera images as the vision tower takes them, float32 in [-1, 1]: uint8 pixels looked up in `values`
    (`pixel_values` on their device; a lookup is exact on any device), float32 ones as they are."""
    if images.dtype != torch.uint8:
        return images
    return values.index_select(0, images.flatten().int()).view(images.shape)


def camera_pixels(images: list[np.ndarray], size: int) -> torch.Tensor:
    """uint8 [H, W, 3] images -> [N, 3, size, size] in one buffer: when every image is at `size` (what openpi
    clients send), their uint8 pixels channels first, one copy each (the vision component maps them to
    [-1, 1]: `unit_pixels`); else float32 in [-1, 1] (`pixels` of each), the others scaled to fit."""
    for image in images:
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] not in (3, 4):
            raise ValueError(f"camera images must be uint8 [H, W, 3], got {image.dtype} {list(image.shape)}")
    if all(image.shape[:2] == (size, size) for image in images):
        out = np.empty((len(images), 3, size, size), np.uint8)
        for row, image in zip(out, images, strict=True):
            row[...] = image[..., :3].transpose(2, 0, 1)
        return torch.from_numpy(out)
    out, values = torch.empty(len(images), 3, size, size), pixel_values()
    for row, image in zip(out, images, strict=True):
        if image.shape[:2] == (size, size):  # a fresh writable uint8 copy, channels first
            row.copy_(unit_pixels(torch.from_numpy(np.array(image[..., :3].transpose(2, 0, 1), order="C")), values))
        else:
            row.copy_(_fitted(image, size)).mul_(2.0).sub_(1.0)
    return out


def _fitted(image: np.ndarray, size: int) -> torch.Tensor:
    """uint8 [H, W, 3+] -> float32 [3, size, size] in [0, 1]: scaled to fit, black bars centred."""
    x = torch.from_numpy(np.array(image[..., :3])).permute(2, 0, 1).float()[None] / 255.0
    height, width = x.shape[-2:]
    ratio = max(width / size, height / size)
    scaled = (int(height / ratio), int(width / ratio))
    x = F.interpolate(x, size=scaled, mode="bilinear", align_corners=False).clamp(0.0, 1.0)
    top, extra_h = divmod(size - scaled[0], 2)
    left, extra_w = divmod(size - scaled[1], 2)
    return F.pad(x, (left, left + extra_w, top, top + extra_h))[0]


def noise(seed: int, chunk: int, width: int) -> torch.Tensor:
    """The flow's starting noise [chunk, width] for `seed` (standard normal, float32)."""
    return torch.randn(chunk, width, generator=torch.Generator().manual_seed(seed))


def camera_images(media: list[Mapping[str, Any]], cameras: tuple[str, ...]) -> dict[str, np.ndarray]:
    """camera -> image of a request's media parts (named by camera, or unnamed in camera order)."""
    if other := sorted({str(m.get("type")) for m in media} - {"image"}):
        raise ValueError(f"Pi0.5 reads camera images, not {other}")
    named = {}
    for part in media:
        name = part.get("name")
        if name is None:
            continue
        if name not in cameras:
            raise ValueError(f"unknown camera {name!r}; this policy's cameras are {list(cameras)}")
        if name in named:
            raise ValueError(f"two images for camera {name!r}")
        named[name] = np.asarray(part["data"])
    unnamed = [np.asarray(m["data"]) for m in media if m.get("name") is None]
    free = [c for c in cameras if c not in named]
    if len(unnamed) > len(free):
        raise ValueError(f"{len(named) + len(unnamed)} images for {len(cameras)} cameras {list(cameras)}")
    named.update(zip(free, unnamed, strict=False))
    if not named:
        raise ValueError(f"Pi0.5 needs at least one camera image (cameras: {list(cameras)})")
    return named


def state_vector(value: Any, size: int) -> np.ndarray:
    """Option `state`: `size` finite numbers."""
    try:
        state = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"state must be a list of {size} numbers") from None
    if state.shape != (size,):
        raise ValueError(f"state must hold {size} numbers (this robot's state size), got shape {list(state.shape)}")
    if not np.isfinite(state).all():
        raise ValueError("state holds a value that is not a finite number")
    return state


class Pi05Processor(Processor):
    """Request -> `images` [C, 3, S, S] (present cameras, in camera order; uint8 pixels when every camera is at
    the policy's size, else float32 in [-1, 1]: `camera_pixels`), `prompt_ids` [T], `noise` [chunk,
    max_action_dim]; output `actions` -> float32 [chunk, action_dim] in the robot's units."""

    def __init__(self, robot: RobotSpec, tokenizer) -> None:
        self.robot, self.tokenizer = robot, tokenizer

    def validate_options(self, options: Mapping[str, Any]) -> None:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:  # the chunk's size and the action width are the checkpoint's, not a request's
            raise ValueError(f"unknown option {unknown[0]!r}; Pi0.5 takes {', '.join(OPTIONS)}")
        if list(options.get("modalities") or ["actions"]) != ["actions"]:
            raise ValueError(f"modalities={options['modalities']!r}: Pi0.5 answers actions only")
        steps = options.get("num_steps")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS):
            raise ValueError(f"num_steps must be an integer in [1, {MAX_STEPS}], got {steps!r}")
        seed = options.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        self.validate_options(options)
        robot = self.robot
        task = request.get("text")
        if not isinstance(task, str) or not task.strip():
            raise ValueError("Pi0.5 needs the task as the request's text")
        images = camera_images(list(request.get("media") or []), robot.cameras)
        state = state_vector(options.get("state"), robot.state_dim)
        ids = self.tokenizer.encode(prompt_text(task, robot.state_stats.normalize(state), robot.max_state_dim))
        if options.get("num_steps") is None:
            options["num_steps"] = robot.num_steps
        if options.get("seed") is None:
            options["seed"] = secrets.randbelow(2**31)
        return {"images": camera_pixels([images[c] for c in robot.cameras if c in images], robot.image_size),
                "prompt_ids": torch.tensor(ids[:robot.max_prompt_tokens], dtype=torch.long),
                "noise": noise(int(options["seed"]), robot.chunk_size, robot.max_action_dim)}

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        if name != "actions":
            return tensor.detach().float().cpu().numpy()
        actions = tensor.detach().float().cpu().numpy()[:, :self.robot.action_dim]
        return self.robot.action_stats.unnormalize(actions).astype(np.float32)

    def warm(self) -> None:
        self.tokenizer.warm()

    # -- the openpi policy protocol (mstar/server/routes_openpi.py) --

    def policy_metadata(self) -> dict[str, Any]:
        """What a robot client needs to build observations, with an example of one."""
        robot, side = self.robot, self.robot.image_size
        example = {"images": {c: np.zeros((side, side, 3), np.uint8) for c in robot.cameras},
                   "state": np.zeros(robot.state_dim, np.float32), "prompt": "pick up the cube"}
        return {"policy": "pi05", "cameras": list(robot.cameras), "image_size": [side, side],
                "state_dim": robot.state_dim, "action_shape": [robot.chunk_size, robot.action_dim],
                "num_steps": robot.num_steps, "example_observation": example}

    def observation_request(self, observation: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """{"images": {camera: uint8 [H, W, 3] or [3, H, W]}, "state": [state_dim], "prompt": str, and
        optionally "seed", "num_steps"} -> (request, options)."""
        if not isinstance(observation, dict):
            raise ValueError("an observation is a map of images, state and prompt")
        if unknown := sorted(set(observation) - {"images", "state", "prompt", "seed", "num_steps"}):
            raise ValueError(f"unknown observation keys {unknown}; send images, state and prompt "
                             "(the metadata's example_observation)")
        images = observation.get("images")
        if not isinstance(images, dict) or not all(isinstance(v, np.ndarray) for v in images.values()):
            raise ValueError(f"images must map camera names ({list(self.robot.cameras)}) to uint8 arrays")
        media = [{"type": "image", "name": str(name), "data": _channels_last(image)} for name, image in images.items()]
        state = observation.get("state")
        options = {"state": np.asarray(state).tolist() if isinstance(state, np.ndarray | list) else state}
        options.update({k: int(observation[k]) for k in ("seed", "num_steps") if k in observation})
        return {"text": observation.get("prompt"), "media": media}, options


def _channels_last(image: np.ndarray) -> np.ndarray:
    """[3, H, W] images (as some openpi clients send them) as [H, W, 3]."""
    return image.transpose(1, 2, 0) if image.ndim == 3 and image.shape[0] == 3 and image.shape[-1] != 3 else image
