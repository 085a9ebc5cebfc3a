"""The whole served BAGEL (tiny, float32, weights from a checkpoint-layout folder) against the plain unbatched
reference written from the upstream semantics (tests/models/bagel_upstream.py): greedy text for image + text
prompts, the latents after every denoising step within 1e-4 for generation and editing with guidance on and
off (three branches and renorms), thinking before drawing. Every request is submitted at once, so each runs
batched with the others and must still get what it gets alone; afterwards no context is left behind."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest
import torch

from mstar.models.bagel.config import TokenIds
from mstar.models.bagel.tiny import TINY_LLM, TINY_VIT, tiny_config, tiny_tokenizer_folder
from mstar.runtime.offline import MStar
from tests.models.bagel_reference import (
    diffusers_vae_state,
    llm_shapes,
    random_state,
    vae_shapes,
    vit_shapes,
    write_checkpoint,
)
from tests.models.bagel_upstream import UpstreamBagel

diffusers = pytest.importorskip("diffusers")
tokenizers = pytest.importorskip("tokenizers")
pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-4
STEPS = 4  # grid points: three Euler steps
RNG = np.random.default_rng(0)
PHOTO = (RNG.random((40, 56, 3)) * 255).astype(np.uint8)  # resized to 48x64 (VAE) and 42x56 (ViT)
SKETCH = (RNG.random((64, 64, 3)) * 255).astype(np.uint8)


def _image_args(**overrides):
    args = {"steps": STEPS, "text_scale": 4.0, "img_scale": 1.5, "interval": (0.4, 1.0), "shift": 3.0,
            "renorm_type": "global", "renorm_min": 0.0}
    return {**args, **overrides}


# (name, request, options, reference interleave() arguments)
CASES = [
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                        {"type": "text", "text": "What is in this picture?"}]}],
              "media": [{"type": "image", "data": PHOTO}]},
     {"max_tokens": 6}, {"items": [PHOTO, "What is in this picture?"], "think": False, "understanding": True,
                         "max_tokens": 6}),
    ("chat_logprobs", {"text": "What is in this picture?", "media": [{"type": "image", "data": PHOTO}]},
     {"max_tokens": 6, "logprobs": 2}, {"items": [PHOTO, "What is in this picture?"], "think": False,
                                        "understanding": True, "max_tokens": 6}),
    ("chat_think", {"text": "What is this?", "media": [{"type": "image", "data": SKETCH}]}, {"think": True, "max_tokens": 4},
     {"items": [SKETCH, "What is this?"], "think": True, "understanding": True, "max_tokens": 4}),
    ("chat_turns", {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "A cat."}, {"role": "user", "content": "And the colors?"}],
        "media": [{"type": "image", "data": PHOTO}]}, {"max_tokens": 5},
     {"items": [PHOTO, "Hi", "A cat.", "And the colors?"], "think": False, "understanding": True, "max_tokens": 5}),
    ("generate", {"text": "A photo of a red fox"}, {"modalities": ["image"], "seed": 3},
     {"items": ["A photo of a red fox"], "think": False, "understanding": False, "size": (64, 64),
      "seed": 3, **_image_args()}),
    ("generate_unguided", {"text": "A red fox"}, {"modalities": ["image"], "seed": 4, "guidance_scale": 1.0,
                                                  "size": "32x48"},
     {"items": ["A red fox"], "think": False, "understanding": False, "size": (48, 32), "seed": 4,
      **_image_args(text_scale=1.0)}),
    ("generate_channel", {"text": "Two cups on a table"},
     {"modalities": ["image"], "seed": 5, "cfg_renorm_type": "channel", "cfg_renorm_min": 0.5,
      "image_guidance_scale": 1.0, "cfg_interval": [0.0, 0.9]},
     {"items": ["Two cups on a table"], "think": False, "understanding": False, "size": (64, 64), "seed": 5,
      **_image_args(renorm_type="channel", renorm_min=0.5, img_scale=1.0, interval=(0.0, 0.9))}),
    ("edit", {"text": "Make the sky purple", "media": [{"type": "image", "data": PHOTO}]},
     {"modalities": ["image"], "seed": 6},
     {"items": [PHOTO, "Make the sky purple"], "think": False, "understanding": False, "seed": 6,
      **_image_args(img_scale=2.0, interval=(0.0, 1.0), renorm_type="text_channel")}),
    ("edit_unguided", {"text": "Add a boat", "media": [{"type": "image", "data": SKETCH}]},
     {"modalities": ["image"], "seed": 7, "guidance_scale": 1.0},
     {"items": [SKETCH, "Add a boat"], "think": False, "understanding": False, "seed": 7,
      **_image_args(text_scale=1.0, img_scale=2.0, interval=(0.0, 1.0), renorm_type="text_channel")}),
    ("think_then_draw", {"text": "A small boat on a lake"}, {"modalities": ["text", "image"], "seed": 8, "max_tokens": 3},
     {"items": ["A small boat on a lake"], "think": True, "understanding": False, "size": (64, 64), "seed": 8,
      "max_tokens": 3, **_image_args()}),
]


@pytest.fixture(scope="module")
def weights():
    cfg = tiny_config()
    return cfg, random_state({**llm_shapes(cfg), **vit_shapes(cfg)}, 11), random_state(vae_shapes(cfg), 12, scale=0.1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, weights):
    _, ema, ae = weights
    root = write_checkpoint(tmp_path_factory.mktemp("bagel_tiny"), (TINY_LLM, TINY_VIT), ema, ae)
    for file in tiny_tokenizer_folder().iterdir():
        shutil.copy(file, root / file.name)
    return root


@pytest.fixture(scope="module")
def reference(weights, folder):
    cfg, ema, ae = weights
    widths = [cfg.vae.ch * m for m in cfg.vae.ch_mult]
    vae = diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * len(widths), up_block_types=("UpDecoderBlock2D",) * len(widths),
        block_out_channels=tuple(widths), layers_per_block=cfg.vae.num_res_blocks, latent_channels=cfg.vae.z_channels,
        norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=cfg.vae.scale_factor,
        shift_factor=cfg.vae.shift_factor).eval()
    vae.load_state_dict(diffusers_vae_state(ae, cfg))
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = TokenIds(*(tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")))
    return UpstreamBagel(cfg, ema, vae, tok, ids, vae_sizes=(128, 32, 16), vit_sizes=(112, 28, 14))


@pytest.fixture(scope="module")
def served(folder):
    """Every case's raw outputs, all submitted at once; and the LLM's contexts left afterwards."""
    with MStar("bagel", tiny=True, model_path=str(folder)) as m:
        handles = {name: m.submit(request, debug_outputs=True, temperature=0.0, num_inference_steps=STEPS, **options)
                   for name, request, options, _ in CASES}
        results = {name: h.result() for name, h in handles.items()}
        llm, deadline = m.runtime.workers[0].engines["llm"].module, time.monotonic() + 5
        while llm.num_contexts and time.monotonic() < deadline:  # releases follow the results
            time.sleep(0.01)
        left = llm.num_contexts
    return results, left


def _tokens(result) -> list[int]:
    return [int(t) for t in torch.cat([v.reshape(-1) for v in result.outputs.get("text", [])]).tolist()] \
        if result.outputs.get("text") else []


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_served_equals_the_upstream_reference(name, served, reference):
    _, request, options, args = next(c for c in CASES if c[0] == name)
    want = reference.interleave(**args)
    got = served[0][name]
    if "text" in want:
        tokens = _tokens(got)
        eos = reference.ids.eos
        assert [t for t in tokens if t != eos] == want["text"]
        assert len(want["text"]) == len(tokens) or tokens[-1] == eos
    if "steps" in want:
        steps = [s[0] for s in got.outputs["step_latents"]]
        assert len(steps) == STEPS - 1
        for ours, theirs in zip(steps, want["steps"], strict=True):
            torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
        image = np.asarray(got.outputs["image"][0])
        assert image.shape == want["image"].shape and image.dtype == np.uint8
        assert np.abs(image.astype(int) - want["image"].astype(int)).max() <= 1  # truncation at float noise


def test_served_logprobs_are_the_reference_log_softmax(served, reference):
    """Option logprobs gives each token's and the top 2 (they were accepted and never computed)."""
    _, _, _, args = next(c for c in CASES if c[0] == "chat_logprobs")
    steps: list[torch.Tensor] = []
    reference.interleave(**args, logprobs=steps)
    got = served[0]["chat_logprobs"]
    tokens = _tokens(got)
    assert len(got.outputs["logprob"]) == len(got.outputs["top_ids"]) == len(tokens) > 0
    for j, token in enumerate(tokens):
        want = steps[j].topk(2)
        torch.testing.assert_close(got.outputs["logprob"][j].reshape(()), steps[j][token], atol=TOL, rtol=0)
        assert got.outputs["top_ids"][j].tolist() == want.indices.tolist()
        torch.testing.assert_close(got.outputs["top_logprobs"][j], want.values, atol=TOL, rtol=0)
    assert "logprob" not in served[0]["chat"].outputs  # not asked


def test_no_context_is_left_behind(served):
    assert served[1] == 0


def test_dummy_weights_keep_the_folders_configs(tmp_path):
    from mstar.models.bagel.model import BagelModel

    dummy = BagelModel(BagelModel.make_config(tiny=True), load_format="dummy", model_path=str(tmp_path))
    assert dummy.checkpoint is None and dummy.folder == tmp_path
    assert BagelModel(BagelModel.make_config(tiny=True), model_path=str(tmp_path)).checkpoint == tmp_path
    assert BagelModel(BagelModel.make_config(tiny=True)).checkpoint is None
    with pytest.raises(ValueError, match=r"bagel needs --model-path \(a folder or the repo id ByteDance-Seed"):
        _ = BagelModel(BagelModel.make_config()).checkpoint
