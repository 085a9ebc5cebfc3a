"""BAGEL's processor: the upstream image resizing, the three guidance contexts of a segment plan, the order of
chat parts, and the 400s that name a bad option or input."""

from __future__ import annotations

import numpy as np
import pytest

from mstar.models.bagel.model import BagelModel
from mstar.models.bagel.plan import BRANCH_BITS, TEXT, VAE, VIT, branch_masks, decode_segments
from mstar.models.bagel.processor import GEN_THINK_PROMPT, Resize

FULL, NO_TEXT, NO_IMAGE = (BRANCH_BITS[b] for b in ("full", "no_text", "no_image"))


@pytest.fixture(scope="module")
def model():
    return BagelModel(BagelModel.make_config(tiny=True))


@pytest.fixture(scope="module")
def processor(model):
    return model.processor()


def _image(height: int, width: int) -> np.ndarray:
    return (np.random.default_rng(height * width).random((height, width, 3)) * 255).astype(np.uint8)


@pytest.mark.parametrize(("size", "vae", "vit"), [
    ((1024, 768), (1024, 768), (980, 728)),  # (width, height) -> the VAE's and then the ViT's size
    ((300, 200), (768, 512), (770, 518)),  # upscaled to the short side's minimum (the ViT's range takes it as is)
    ((4000, 1000), (1024, 256), (980, 252)),  # the long side wins over the short side's minimum
    ((1000, 1000), (992, 992), (980, 980)),
])
def test_resize_matches_the_upstream_rule(size, vae, vit):
    vae_size = Resize(1024, 512, 16).size(*size)
    assert vae_size == vae
    assert Resize(980, 224, 14).size(*vae_size) == vit


def test_branch_masks_are_the_inferencers_three_contexts():
    # image, then a prompt: no_text keeps the image, no_image the prompt
    assert branch_masks([VAE, VIT, TEXT], think=False) == [FULL | NO_TEXT, FULL | NO_TEXT, FULL | NO_IMAGE]
    # a prompt alone: the no-text context is empty
    assert branch_masks([TEXT], think=False) == [FULL | NO_IMAGE]
    # thinking: the system prompt is in all three; only the last text is missing from no_text
    assert branch_masks([TEXT, TEXT, TEXT], think=True) == [7, 7, FULL | NO_IMAGE]


def test_an_edit_plans_both_image_encodings_and_takes_the_images_size(processor):
    options = {**BagelModel.default_options, "modalities": ["image"], "seed": 1}
    x = processor.inputs({"text": "purple sky", "media": [{"type": "image", "data": _image(44, 60)}]}, options)
    segments = decode_segments(x["segments"])
    assert [s.kind for s in segments] == [VAE, VIT, TEXT]
    assert (options["height"], options["width"]) == (48, 64) and (options["latent_rows"], options["latent_cols"]) == (3, 4)
    assert segments[0].tokens == 12 and x["vae_pixels"].numel() == 3 * 48 * 64
    assert segments[1].tokens == x["vit_patches"].shape[0] == int(x["vit_lengths"].sum())
    assert options["cfg_renorm_type"] == "text_channel" and options["cfg_interval"] == [0.0, 1.0]
    assert options["image_guidance_scale"] == 2.0 and options["no_image_context"]


def test_a_text_answer_reads_images_through_the_vit_only(processor):
    options = {**BagelModel.default_options}
    x = processor.inputs({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": "a"}},
        {"type": "image_url", "image_url": {"url": "b"}}]}],
        "media": [{"type": "image", "data": _image(28, 28)}, {"type": "image", "data": _image(56, 28)}]}, options)
    assert [s.kind for s in decode_segments(x["segments"])] == [TEXT, VIT, VIT]
    assert "vae_pixels" not in x and not options["image_output"]


def test_thinking_before_drawing_adds_the_planning_prompt(processor, model):
    options = {**BagelModel.default_options, "modalities": ["text", "image"]}
    x = processor.inputs({"text": "a fox"}, options)
    ids = model.tokenizer.encode(GEN_THINK_PROMPT, add_special_tokens=False)
    assert options["think"] and options["no_image_context"]
    assert x["prompt_ids"][1:1 + len(ids)].tolist() == ids


@pytest.mark.parametrize(("request_", "options", "message"), [
    ({"text": "x"}, {"modalities": ["audio"]}, "modalities"),
    ({"text": "x"}, {"modalities": ["image"], "size": "40x32"}, "width=40 must be a multiple of 16"),
    ({"text": "x"}, {"modalities": ["image"], "size": "big"}, r"size='big' must look like 'WxH', e\.g\. '64x64'"),
    ({"text": "x"}, {"modalities": ["image"], "seed": -1}, r"seed must be an integer in \[0, "),
    ({"text": "x"}, {"modalities": ["image"], "cfg_interval": [0.8, 0.2]}, "cfg_interval"),
    ({"text": "x"}, {"modalities": ["image"], "cfg_renorm_type": "l2"}, "cfg_renorm_type"),
    ({"text": "x"}, {"modalities": ["image"], "num_inference_steps": 1}, "num_inference_steps"),
    ({"text": "x", "media": [{"type": "image", "data": _image(32, 32)},
                             {"type": "image", "name": "mask", "data": _image(32, 32)}]},
     {"modalities": ["image"]}, "no mask"),
    ({"text": "x", "media": [{"type": "audio", "data": np.zeros(10, np.float32)}]}, {}, "'audio'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}}]}]}, {},
     "no decoded image"),
    ({"text": ""}, {}, "needs a prompt"),
    ({"text": "a fox " * 20000}, {}, "the model's context of 32768 tokens"),
    ({"text": "a fox"}, {"max_tokens": 40000}, "max_tokens=40000 plus the"),
])
def test_bad_requests_are_refused_naming_the_cause(processor, request_, options, message):
    with pytest.raises(ValueError, match=message):
        opts = {**BagelModel.default_options, **options}
        processor.validate_options(opts)
        processor.inputs(request_, opts)
