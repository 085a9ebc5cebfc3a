"""Pi0.5's camera pixels (#39): images at the policy's size take the one-copy path into one buffer, bit for bit
what openpi's float mapping gives ((x / 255) * 2 - 1 in float32) at every uint8 value; other sizes are scaled
to fit with black bars; images as the websocket hands them (read-only buffers, channels first) work."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mstar.models.pi05.processor import _channels_last, camera_pixels, pixels


def _reference(image: np.ndarray, size: int) -> torch.Tensor:
    """openpi's resize_with_pad to `size` and the map of [0, 1] to [-1, 1], in float32 ops one at a time."""
    x = torch.from_numpy(np.array(image[..., :3])).permute(2, 0, 1).float()[None] / 255.0
    height, width = x.shape[-2:]
    if (height, width) != (size, size):
        ratio = max(width / size, height / size)
        scaled = (int(height / ratio), int(width / ratio))
        x = F.interpolate(x, size=scaled, mode="bilinear", align_corners=False).clamp(0.0, 1.0)
        top, extra_h = divmod(size - scaled[0], 2)
        left, extra_w = divmod(size - scaled[1], 2)
        x = F.pad(x, (left, left + extra_w, top, top + extra_h))
    return x[0] * 2.0 - 1.0


def test_every_uint8_value_maps_bit_for_bit() -> None:
    values = np.arange(256, dtype=np.uint8)
    image = np.stack([np.roll(values, shift) for shift in range(256 * 3)]).reshape(256, 256, 3)  # every value, every lane
    got = pixels(image, 256)
    assert got.dtype == torch.float32 and got.shape == (3, 256, 256) and got.is_contiguous()
    assert torch.equal(got, _reference(image, 256))


def test_cameras_fill_one_buffer_in_order_at_any_size() -> None:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8), rng.integers(0, 256, (120, 200, 4), dtype=np.uint8),
              rng.integers(0, 256, (224, 224, 3), dtype=np.uint8), rng.integers(0, 256, (300, 90, 3), dtype=np.uint8)]
    got = camera_pixels(images, 224)
    assert got.shape == (4, 3, 224, 224) and got.is_contiguous()
    assert torch.equal(got, torch.stack([_reference(image, 224) for image in images]))
    assert (got[1, :, :30] == -1).all()  # the 120-row image's black bar on top


def test_images_as_the_websocket_hands_them() -> None:
    """Read-only arrays over the message's bytes, and channels-first ones, convert without warnings or copies
    of the caller's data being written."""
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    frozen = np.frombuffer(image.tobytes(), dtype=np.uint8).reshape(image.shape)
    channels_first = _channels_last(np.ascontiguousarray(image.transpose(2, 0, 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for sent in (frozen, channels_first):
            assert torch.equal(pixels(sent, 224), _reference(image, 224))
    assert np.array_equal(frozen, image)


@pytest.mark.parametrize("image", [np.zeros((8, 8, 3), np.float32), np.zeros((8, 8), np.uint8),
                                   np.zeros((8, 8, 2), np.uint8)])
def test_other_arrays_are_refused(image: np.ndarray) -> None:
    with pytest.raises(ValueError, match=r"uint8 \[H, W, 3\]"):
        camera_pixels([np.zeros((8, 8, 3), np.uint8), image], 8)
