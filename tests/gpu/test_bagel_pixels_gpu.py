"""BAGEL's uint8 pixels (#37) mapped on the GPU: every value is the host formula's float32 value, and a request's
ViT embeddings and VAE latents from its uint8 walk inputs are those of the host's float32 pixels, bit for bit."""

from __future__ import annotations

import numpy as np
import torch

from mstar.models.bagel.embeddings import patchify, pixel_values, unit_pixels
from mstar.models.bagel.model import BagelModel

CUDA = torch.device("cuda")


def _float_pixels(image: np.ndarray) -> torch.Tensor:
    """The processor's float path before uint8 pixels: uint8 [H, W, 3] -> float32 [3, H, W] in [-1, 1]."""
    return torch.from_numpy(np.array(image, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1.0


def test_uint8_pixels_map_on_the_gpu_as_on_the_host() -> None:
    values = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(unit_pixels(values.to(CUDA), pixel_values().to(CUDA)).cpu(), values.float() / 127.5 - 1.0)
    model = BagelModel(BagelModel.make_config(tiny=True))
    processor = model.processor()
    image = np.random.default_rng(0).integers(0, 256, (44, 60, 3), dtype=np.uint8)
    options = {**BagelModel.default_options, "modalities": ["image"], "seed": 1}
    x = processor.inputs({"text": "purple sky", "media": [{"type": "image", "data": image}]}, options)
    vit, vae = model.build_component("vit", CUDA).module, model.build_component("vae", CUDA).module
    vae_image = processor._resize(image, processor.defaults.vae)
    vit_image = processor._resize(vae_image, processor.defaults.vit)
    with torch.no_grad():
        patches = patchify(_float_pixels(vit_image), processor.cfg.vit.patch_size).to(CUDA)
        want = vit.tower(patches, x["vit_positions"].to(CUDA), x["vit_lengths"].tolist())
        got = vit.run_batch("encode", "vit", [x], [options])[0]["vit_embeds"]
        assert torch.equal(got, want)
        latents = vae.vae.encode(_float_pixels(vae_image)[None].to(CUDA))[0].float()
        want = patchify(latents, processor.cfg.latent_patch_size)
        assert torch.equal(vae.run_batch("encode", "encode", [x], [options])[0]["vae_latents"], want)
