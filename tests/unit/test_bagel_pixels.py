"""BAGEL's image pixels travel to the ViT and VAE components as uint8 (#37) and are mapped to [-1, 1] there by a
lookup in a 256-entry table: bit for bit what the processor's float path gave (x / 127.5 - 1 in float32 ops on
the host) at every uint8 value, in patchify's layout, and through the components to the same ViT embeddings and
VAE latents."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.models.bagel.embeddings import patchify, pixel_patches, pixel_values, unit_pixels
from mstar.models.bagel.model import BagelModel
from mstar.models.bagel.plan import VAE, VIT, decode_segments

pytestmark = pytest.mark.usefixtures("one_thread")


def _float_pixels(image: np.ndarray) -> torch.Tensor:
    """The processor's float path before uint8 pixels: uint8 [H, W, 3] -> float32 [3, H, W] in [-1, 1]."""
    return torch.from_numpy(np.array(image, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1.0


def _every_value(height: int, width: int, seed: int) -> np.ndarray:
    """A read-only uint8 [H, W, 3] image holding all 256 values (the rest random), as decoded media arrive."""
    image = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    image.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)
    image.flags.writeable = False
    return image


@pytest.fixture(scope="module")
def model():
    return BagelModel(BagelModel.make_config(tiny=True))


def test_the_table_is_the_host_formula_at_every_value() -> None:
    table = pixel_values()
    assert table.dtype == torch.float32 and table.shape == (256,)
    for value in range(256):  # numpy's float32 scalars round after each op as the float32 tensor ops do
        assert table[value].item() == float(np.float32(value) / np.float32(127.5) - np.float32(1.0)), value
    image = _every_value(40, 56, 0)
    assert torch.equal(unit_pixels(torch.from_numpy(image.copy()).permute(2, 0, 1), table), _float_pixels(image))


def test_uint8_patches_are_patchifys_layout_and_map_to_the_float_patches() -> None:
    image = _every_value(42, 56, 1)
    got = pixel_patches(image, 14)
    assert got.dtype == torch.uint8 and got.shape == (12, 14 * 14 * 3) and got.is_contiguous()
    assert torch.equal(got, patchify(torch.from_numpy(image.copy()).permute(2, 0, 1), 14))
    assert torch.equal(unit_pixels(got, pixel_values()), patchify(_float_pixels(image), 14))
    got[0, 0] = 255 - image[0, 0, 0]  # a buffer of its own: the request's image is not written
    assert image[0, 0, 0] != got[0, 0]


def test_float_pixels_are_refused() -> None:
    with pytest.raises(TypeError, match="uint8"):
        unit_pixels(torch.zeros(4, 12), pixel_values())


def _edit(processor, images: list[np.ndarray]) -> tuple[dict, dict]:
    options = {**BagelModel.default_options, "modalities": ["image"], "seed": 1}
    media = [{"type": "image", "data": image} for image in images]
    return processor.inputs({"text": "purple sky", "media": media}, options), options


def test_the_processor_sends_uint8_pixels_that_map_to_its_old_float_inputs(model) -> None:
    processor = model.processor()
    images = [_every_value(44, 60, 2), _every_value(70, 50, 3)]
    x, _ = _edit(processor, images)
    assert x["vit_patches"].dtype == torch.uint8 and x["vae_pixels"].dtype == torch.uint8
    p, table = processor.cfg.vit.patch_size, pixel_values()
    vae_images = [processor._resize(image, processor.defaults.vae) for image in images]
    vit_images = [processor._resize(image, processor.defaults.vit) for image in vae_images]
    assert torch.equal(unit_pixels(x["vit_patches"], table),
                       torch.cat([patchify(_float_pixels(image), p) for image in vit_images]))
    assert torch.equal(unit_pixels(x["vae_pixels"], table),
                       torch.cat([_float_pixels(image).flatten() for image in vae_images]))


def test_the_worker_receives_a_quarter_of_the_bytes(model) -> None:
    from mstar.transport.tensors import discard_payload, pack_tensor

    x, _ = _edit(model.processor(), [_every_value(44, 60, 4)])
    for name in ("vit_patches", "vae_pixels"):
        payload = pack_tensor(x[name], inline_max_bytes=0, session="bageltest")
        try:
            assert payload.dtype == "uint8" and payload.nbytes == x[name].numel()
        finally:
            discard_payload(payload)


def test_the_components_give_the_float_paths_embeddings_and_latents(model) -> None:
    """A request's uint8 walk inputs through the ViT and VAE components (tiny, CPU) against the networks fed
    the float32 inputs the processor made before: equal bit for bit."""
    processor, cpu = model.processor(), torch.device("cpu")
    images = [_every_value(44, 60, 5), _every_value(70, 50, 6)]
    x, options = _edit(processor, images)
    vit, vae = model.build_component("vit", cpu).module, model.build_component("vae", cpu).module
    p, cfg = processor.cfg.vit.patch_size, processor.cfg
    vae_images = [processor._resize(image, processor.defaults.vae) for image in images]
    vit_images = [processor._resize(image, processor.defaults.vit) for image in vae_images]
    got = vit.run_batch("encode", "vit", [x], [options])[0]["vit_embeds"]
    with torch.no_grad():
        want = vit.tower(torch.cat([patchify(_float_pixels(image), p) for image in vit_images]), x["vit_positions"],
                         x["vit_lengths"].tolist())
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert [s.kind for s in decode_segments(x["segments"])].count(VIT) == 2
    got = vae.run_batch("encode", "encode", [x], [options])[0]["vae_latents"]
    with torch.no_grad():
        want = torch.cat([patchify(vae.vae.encode(_float_pixels(image)[None])[0].float(), cfg.latent_patch_size)
                          for image in vae_images])
    assert [s.kind for s in decode_segments(x["segments"])].count(VAE) == 2
    assert torch.equal(got, want)
