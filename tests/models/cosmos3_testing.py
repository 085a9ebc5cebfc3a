"""Shared helpers of the Cosmos3 tests: a tiny random Diffusers-layout pipeline folder written by the
reference classes (generator, Wan VAE, scheduler, sound tokenizer, tokenizer), and runs of diffusers' Cosmos3OmniPipeline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mstar.models.cosmos3.tiny import SCHEDULER, TINY_SOUND, TINY_TRANSFORMER
from tests.models.wan22_testing import randomize

PROMPTS = ("A cat and a dog bake a cake in a sunny kitchen", "Waves crash on a rocky shore at sunset",
           "A robot arm picks up the red cube and places it in the bowl")
NEGATIVE = "blurred details, worst quality"
SIZE = 64  # pixels per side of the tiny runs


def reference_transformer(config: dict | None = None, seed: int = 2):
    """A random diffusers Cosmos3OmniTransformer of `config` (the tiny one by default)."""
    from diffusers import Cosmos3OmniTransformer

    kwargs = {k: v for k, v in (config or TINY_TRANSFORMER).items() if not k.startswith("_")}
    transformer = Cosmos3OmniTransformer(**kwargs).eval()
    randomize(transformer, seed)
    return transformer


def write_pipeline_dir(root: Path) -> Path:
    """A tiny Diffusers-layout Cosmos3 folder (random weights) under `root`, saved by the reference pipeline."""
    from diffusers import Cosmos3AVAEAudioTokenizer, Cosmos3OmniPipeline, UniPCMultistepScheduler
    from transformers import AutoTokenizer

    from mstar.models.cosmos3.tokenizer import write_tiny_tokenizer
    from tests.models.wan22_testing import tiny_reference_vae

    vae = tiny_reference_vae()  # the Wan tests' tiny VAE: 16 latent channels, as the tiny generator
    tokenizer = AutoTokenizer.from_pretrained(write_tiny_tokenizer(root / "_tokenizer"))
    scheduler = UniPCMultistepScheduler(**{k: v for k, v in SCHEDULER.items() if not k.startswith("_")})
    sound = Cosmos3AVAEAudioTokenizer(**{k: v for k, v in TINY_SOUND.items() if not k.startswith("_")}).eval()
    randomize(sound, 4)
    pipe = Cosmos3OmniPipeline(transformer=reference_transformer(), text_tokenizer=tokenizer, vae=vae,
                               scheduler=scheduler, sound_tokenizer=sound, enable_safety_checker=False)
    pipe.save_pretrained(root)
    return root


def reference_pipeline(root: Path):
    """diffusers' Cosmos3OmniPipeline loaded from the folder (safety checker off)."""
    from diffusers import Cosmos3OmniPipeline

    return Cosmos3OmniPipeline.from_pretrained(root, enable_safety_checker=False)


def run_reference(pipe, steps: int, seed: int, **kwargs) -> dict:
    """Latents after every step, frames [T, H, W, 3] float in [0, 1] and actions of one reference run."""
    captured: list[torch.Tensor] = []

    def callback(_pipe, _i, _t, values):
        captured.append(values["latents"].clone())
        return {}

    out = pipe(num_inference_steps=steps, generator=torch.Generator().manual_seed(seed), output_type="np",
               callback_on_step_end=callback, enable_safety_check=False, **kwargs)
    return {"steps": captured, "frames": torch.from_numpy(np.asarray(out.video)),
            "actions": None if out.action is None else out.action[0],
            "audio": None if out.sound is None else out.sound.t()}


def outputs_of(result) -> dict:
    """Our run's step latents (list), float frames and actions, from a Result with debug outputs."""
    out = result.outputs
    return {"steps": out.get("step_latents", []), "frames": out["frames"][0] if "frames" in out else None,
            "video": out["video"][0] if "video" in out else None,
            "actions": torch.as_tensor(out["actions"][0]) if "actions" in out else None,
            "audio": torch.as_tensor(out["audio"][0]) if "audio" in out else None}


def pixels(seed: int, height: int = SIZE, width: int = SIZE) -> np.ndarray:
    """A random uint8 image [height, width, 3]."""
    return (torch.rand(height, width, 3, generator=torch.Generator().manual_seed(seed)) * 255).to(torch.uint8).numpy()
