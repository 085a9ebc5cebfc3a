"""Pi0.5's camera pixels (#39): images at the policy's size leave the processor as uint8 pixels in one buffer
(what a worker process receives) and are mapped to [-1, 1] by a lookup, bit for bit what openpi's float mapping
gives ((x / 255) * 2 - 1 in float32) at every uint8 value; with a camera at another size the batch is float32,
that one scaled to fit with black bars; images as the websocket hands them (read-only buffers, channels first)
work."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mstar.models.pi05.processor import _channels_last, camera_pixels, pixel_values, pixels, unit_pixels


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


def test_the_lookup_is_the_float_formula_at_every_value() -> None:
    """The table the vision component maps uint8 pixels with, against the host formula one value at a time
    (Python floats rounded to float32 after each op, as the float32 tensor ops round)."""
    table = pixel_values()
    assert table.dtype == torch.float32 and table.shape == (256,)
    for value in range(256):
        x = np.float32(value) / np.float32(255.0)
        assert table[value].item() == float(x * np.float32(2.0) - np.float32(1.0)), value
    image = torch.arange(256, dtype=torch.uint8).repeat(3, 2, 1).reshape(1, 3, 16, 32)
    got = unit_pixels(image, table)
    assert got.dtype == torch.float32 and got.shape == image.shape
    assert torch.equal(got, image.float() / 255.0 * 2.0 - 1.0)
    floats = torch.rand(2, 3, 4, 4)
    assert unit_pixels(floats, table) is floats  # already in [-1, 1]: as they came


def test_cameras_at_the_policys_size_stay_uint8() -> None:
    rng = np.random.default_rng(2)
    images = [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), rng.integers(0, 256, (32, 32, 4), dtype=np.uint8)]
    got = camera_pixels(images, 32)
    assert got.dtype == torch.uint8 and got.shape == (2, 3, 32, 32) and got.is_contiguous()
    assert torch.equal(got, torch.stack([torch.from_numpy(image[..., :3]).permute(2, 0, 1) for image in images]))
    assert torch.equal(unit_pixels(got, pixel_values()), torch.stack([_reference(image, 32) for image in images]))


def test_cameras_fill_one_buffer_in_order_at_any_size() -> None:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8), rng.integers(0, 256, (120, 200, 4), dtype=np.uint8),
              rng.integers(0, 256, (224, 224, 3), dtype=np.uint8), rng.integers(0, 256, (300, 90, 3), dtype=np.uint8)]
    got = camera_pixels(images, 224)
    assert got.dtype == torch.float32 and got.shape == (4, 3, 224, 224) and got.is_contiguous()
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


def test_the_request_sends_uint8_cameras_to_the_worker() -> None:
    """What the server hands the vision component's worker for a request whose cameras are at the policy's
    size: uint8 pixels (a quarter of float32's bytes in the shared-memory payload); float32 when one is not."""
    from mstar.models.pi05.model import Pi05
    from mstar.transport.tensors import discard_payload, pack_tensor

    processor = Pi05(Pi05.make_config(tiny=True)).processor()
    side, cameras = processor.robot.image_size, processor.robot.cameras
    rng = np.random.default_rng(3)
    media = [{"type": "image", "name": c, "data": rng.integers(0, 256, (side, side, 3), dtype=np.uint8)}
             for c in cameras]
    request = {"text": "pick", "media": media}
    images = processor.inputs(request, {"state": [0.0] * processor.robot.state_dim})["images"]
    assert images.dtype == torch.uint8 and images.shape == (len(cameras), 3, side, side)
    payload = pack_tensor(images, inline_max_bytes=0, session="pi05test")
    try:
        assert payload.dtype == "uint8" and payload.nbytes == len(cameras) * 3 * side * side
    finally:
        discard_payload(payload)
    media[0] = {**media[0], "data": rng.integers(0, 256, (side + 8, side, 3), dtype=np.uint8)}
    images = processor.inputs(request, {"state": [0.0] * processor.robot.state_dim})["images"]
    assert images.dtype == torch.float32 and images.shape == (len(cameras), 3, side, side)
