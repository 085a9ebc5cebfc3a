"""Shared helpers of the Wan2.2 runtime tests: a tiny random Diffusers-layout pipeline folder written by
the reference classes (text encoder, DiT, scheduler, tokenizer, VAE), and the reference pipelines."""

from __future__ import annotations

import json
import types
from pathlib import Path

import torch

from mstar.models.wan22.tiny import SCHEDULER, TINY_TEXT_ENCODER, TINY_TEXT_LENGTH, TINY_TRANSFORMER

PROMPTS = ("A cat and a dog bake a cake in a sunny kitchen", "Waves crash on a rocky shore at sunset",
           "the camera slowly pans left over the water")
NEGATIVE = "blurred details, worst quality"


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere (norm scales around 1), so a mis-mapped tensor cannot hide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if ("norm" in name and param.ndim == 1) or name.endswith(".gamma")
                        else 0.3 * noise)


def tiny_reference_vae():
    """A random AutoencoderKLWan shaped like our tiny VAE config with 16 latent channels (the tiny DiT's)."""
    from diffusers import AutoencoderKLWan

    from mstar.models.common.wan_vae.vae_config import tiny_vae_config

    kwargs = {k: v for k, v in tiny_vae_config(TINY_TRANSFORMER["in_channels"]).to_hf().items() if not k.startswith("_")}
    torch.manual_seed(12)
    vae = AutoencoderKLWan(**kwargs).eval()
    with torch.no_grad():
        for name, param in vae.named_parameters():
            if name.endswith(".gamma"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
    return vae


def write_pipeline_dir(root: Path) -> Path:
    """A tiny Diffusers-layout Wan2.2 folder (random weights) under `root`."""
    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from mstar.models.wan22.tiny import write_tiny_tokenizer

    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(**TINY_TEXT_ENCODER))
    randomize(text_encoder, 1)
    text_encoder.save_pretrained(root / "text_encoder")
    transformer = WanTransformer3DModel(**{k: v for k, v in TINY_TRANSFORMER.items() if not k.startswith("_")})
    randomize(transformer, 2)
    transformer.save_pretrained(root / "transformer")
    (root / "scheduler").mkdir(parents=True, exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER))
    write_tiny_tokenizer(root / "tokenizer")
    tiny_reference_vae().save_pretrained(root / "vae")
    return root


def reference_pipeline(root: Path, monkeypatch, image_to_video: bool):
    """diffusers' WanPipeline (or WanImageToVideoPipeline) over the folder, expand_timesteps as TI2V-5B."""
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v
    from transformers import AutoTokenizer, UMT5EncoderModel

    for module in (pipeline_wan, pipeline_wan_i2v):  # ftfy is optional for us; make the reference skip it too
        monkeypatch.setattr(module, "ftfy", types.SimpleNamespace(fix_text=lambda s: s), raising=False)
    parts = dict(
        tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
        text_encoder=UMT5EncoderModel.from_pretrained(root / "text_encoder").eval(),
        vae=AutoencoderKLWan.from_pretrained(root / "vae").eval(),
        scheduler=UniPCMultistepScheduler.from_pretrained(root / "scheduler"),
        transformer=WanTransformer3DModel.from_pretrained(root / "transformer").eval(), expand_timesteps=True,
    )
    if image_to_video:
        return WanImageToVideoPipeline(image_encoder=None, image_processor=None, **parts)
    return WanPipeline(**parts)


def run_reference(pipe, steps: int, seed: int, num_frames: int = 9, **kwargs) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(latents after every step, frames [T, H, W, 3] float in [0, 1]) of one 64x64 reference run."""
    captured: list[torch.Tensor] = []

    def callback(_pipe, _i, _t, values):
        captured.append(values["latents"].clone())
        return {}

    frames = pipe(negative_prompt=NEGATIVE, height=64, width=64, num_frames=num_frames, num_inference_steps=steps,
                  guidance_scale=5.0, generator=torch.Generator().manual_seed(seed), output_type="np",
                  max_sequence_length=TINY_TEXT_LENGTH, callback_on_step_end=callback, **kwargs).frames[0]
    return captured, torch.from_numpy(frames)


def outputs_of(result) -> dict:
    """Our run's step latents (list) and float frames, from a Result with debug outputs."""
    return {"steps": result.outputs["step_latents"], "frames": result.outputs["frames"][0],
            "video": result.outputs["video"][0]}
