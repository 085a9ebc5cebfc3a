"""Embodiments and the conditioning canvas of Cosmos3 policy requests.

Each embodiment (a robot dataset's control space) selects one set of the action tower's weights (its
domain id) and has a fixed action width, the sum of its pose and grasp blocks (a 9-D pose, a 1-D
gripper, ...); predicted actions are cut to that width. The conditioning frame is fitted, never
upscaled, into the canvas of the resolution tier whose aspect ratio is closest, and padded.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

DOMAIN_IDS = {
    "no_action": 0, "av": 1, "camera_pose": 2, "hand_pose": 3, "pusht": 4, "libero": 5, "umi": 6,
    "bridge_orig_lerobot": 7, "droid_lerobot": 8, "robomind-franka": 8, "galbot": 9, "robomind-franka-dual": 12,
    "robomind-ur": 13, "agibotworld": 15, "agibot_gear_gripper": 15, "agibot_gear_gripper_ext": 15, "fractal": 20,
}
ACTION_WIDTHS = {
    "av": 9, "camera_pose": 9, "pusht": 2, "umi": 10, "bridge_orig_lerobot": 10, "droid_lerobot": 10,
    "robomind-franka": 10, "robomind-franka-dual": 20, "robomind-ur": 10, "galbot": 30, "agibotworld": 29,
    "agibot_gear_gripper": 29, "agibot_gear_gripper_ext": 29, "fractal": 10, "hand_pose": 57,
}
# tier -> (aspect ratio h / w, (canvas height, canvas width)), as the model was trained
RESOLUTION_TIERS = {
    256: ((1.0, (256, 256)), (0.8, (256, 320)), (1.25, (320, 256)), (0.6, (192, 320)), (1.6666666666666667, (320, 192))),
    480: ((1.0, (640, 640)), (0.7391304347826086, (544, 736)), (1.3529411764705883, (736, 544)),
          (0.5769230769230769, (480, 832)), (1.7333333333333334, (832, 480))),
    704: ((1.0, (960, 960)), (0.7647058823529411, (832, 1088)), (1.3076923076923077, (1088, 832)),
          (0.55, (704, 1280)), (1.8181818181818181, (1280, 704))),
    720: ((1.0, (960, 960)), (0.7536231884057971, (832, 1104)), (1.3269230769230769, (1104, 832)),
          (0.5625, (720, 1280)), (1.7777777777777777, (1280, 720))),
}


def domain_of(name: str) -> tuple[int, int]:
    """(domain id, action width) of an embodiment; ValueError listing the supported ones."""
    if name not in ACTION_WIDTHS:
        raise ValueError(f"embodiment {name!r} is not supported for actions; use one of {sorted(ACTION_WIDTHS)}")
    return DOMAIN_IDS[name], ACTION_WIDTHS[name]


def canvas_of(height: int, width: int, tier: int) -> tuple[int, int]:
    """(height, width) of the tier's canvas whose aspect ratio is closest to height / width."""
    if tier not in RESOLUTION_TIERS:
        raise ValueError(f"resolution_tier={tier} is not one of {sorted(RESOLUTION_TIERS)}")
    ratio = float(height / width)
    return min(RESOLUTION_TIERS[tier], key=lambda entry: abs(entry[0] - ratio))[1]


def frame_pixels(frame: np.ndarray, multiple: int = 16) -> torch.Tensor:
    """uint8 [H, W, 3] -> float32 [3, H', W'] in [-1, 1], H' and W' rounded down to `multiple` (PIL
    bilinear resize when that changes them), as Diffusers' video processor prepares a frame."""
    from PIL import Image

    array = np.asarray(frame)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] not in (3, 4):
        raise ValueError(f"a conditioning frame must be uint8 [H, W, 3], got {array.dtype} {array.shape}")
    image = Image.fromarray(array)
    width, height = (x - x % multiple for x in image.size)
    if min(width, height) < multiple:
        raise ValueError(f"a conditioning frame of {image.size[0]}x{image.size[1]} is smaller than {multiple} pixels")
    if (width, height) != image.size:
        image = image.resize((width, height), resample=Image.Resampling.BILINEAR)
    pixels = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0)
    return (2.0 * pixels - 1.0).permute(2, 0, 1).contiguous()


def fit_canvas(pixels: torch.Tensor, canvas: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """[3, H, W] -> ([3, ch, cw] the frame shrunk to fit (bicubic) and padded on the right and bottom,
    (content height, content width))."""
    target_h, target_w = canvas
    _, h, w = pixels.shape
    scale = min(target_w / w, target_h / h, 1.0)
    content_h, content_w = max(1, int(scale * h + 0.5)), max(1, int(scale * w + 0.5))
    x = pixels[None]
    if (content_h, content_w) != (h, w):
        x = F.interpolate(x, size=(content_h, content_w), mode="bicubic", align_corners=False, antialias=True)
    pad_right, pad_bottom = target_w - content_w, target_h - content_h
    if pad_right or pad_bottom:
        mode = "replicate" if pad_right >= content_w or pad_bottom >= content_h else "reflect"
        x = F.pad(x, (0, pad_right, 0, pad_bottom), mode=mode)
    return x[0], (content_h, content_w)


def latent_crop(content: tuple[int, int], scale: int) -> tuple[int, int]:
    """Latent rows and columns of the content part of a canvas (the padding's latents are dropped)."""
    return max(content[0] // scale, 1), max(content[1] // scale, 1)


def image_condition(image: np.ndarray, height: int, width: int) -> torch.Tensor:
    """uint8 [H, W, 3] -> float32 [3, height, width] in [-1, 1]: scaled to cover (bilinear, antialiased),
    centre-cropped, rounded to whole pixel values, as the reference prepares an image-to-video frame."""
    array = np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] not in (3, 4):
        raise ValueError(f"the reference image must be uint8 [H, W, 3], got {array.dtype} {array.shape}")
    x = torch.from_numpy(np.ascontiguousarray(array[..., :3])).permute(2, 0, 1)[None].float()
    src_h, src_w = x.shape[-2:]
    scale = max(width / src_w, height / src_h)
    resized_h, resized_w = math.ceil(scale * src_h), math.ceil(scale * src_w)
    x = F.interpolate(x, size=(resized_h, resized_w), mode="bilinear", align_corners=False, antialias=True)
    top, left = round((resized_h - height) / 2), round((resized_w - width) / 2)
    x = x[:, :, top:top + height, left:left + width]
    return (x.round().clamp(0, 255) / 127.5 - 1.0)[0]
