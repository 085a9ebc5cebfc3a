"""Wan2.2-TI2V-5B: text (and optionally an image) to video, as a served model.

Lane `video`:  encode_text -> [encode_image] -> denoise -> decode
  encode_text   the UMT5 encoder embeds the prompt and (under guidance) the negative prompt; carried on.
  encode_image  image-to-video only: the VAE encodes the reference image as the first latent frame.
  denoise       `prepare` draws the request's noise (its own generator) and opens its scheduler state;
                then a Loop over the request's steps of Sequential(Parallel(cond DiT, uncond DiT),
                combine): guidance plus one UniPC step, stopping when the schedule is done. Requests
                at different steps share DiT forwards; the branches batch on one device or sit on two
                ranks (placement by node name), with the same graph.
  decode        the VAE turns the final latents into uint8 frames, a few frames at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from mstar.engines.base import StatelessSpec
from mstar.graph import CARRY, ComponentSpec, Emit, Lane, Loop, ModelGraph, Node, Parallel, Sequential, Walk
from mstar.models.base import BuiltComponent, Model
from mstar.models.common.serve_config import DTYPES, ServeConfig, dtype_named
from mstar.models.common.video_options import GENERATION_OPTIONS, positive_bounds
from mstar.models.common.wan_vae.vae_config import WanVAEConfig
from mstar.models.wan22.config import Wan22Config

DIT_BATCH = 16  # DiT rows (requests x guidance branches) per forward


@dataclass(frozen=True)
class Wan22ServeConfig(ServeConfig):
    """How one deployment runs Wan2.2 (YAML `model_kwargs`); request defaults live in the processor.
    `dtype` is the text encoder's and the DiT's (None: float32 on CPU or tiny, else bfloat16)."""

    tiny_in_float32 = True
    vae_dtype: str = "float32"
    # the VAE decode's convolutions in this dtype where it runs channels-last (CUDA); None: float16 for a
    # float32 VAE (TF32's 10-bit mantissa at twice its tensor-core rate, sums and the residual stream stay
    # float32; a request whose decode overflows float16 is decoded again in float32, which then stays),
    # else vae_dtype. "float32": TF32 convolutions
    vae_conv_dtype: str | None = None
    text_length: int | None = None  # prompt tokens; None = 512 (tiny: 16)
    width: int | None = None  # default video size; None = 1280x704 (tiny: 64x64)
    height: int | None = None
    num_frames: int | None = None  # default frame count (4k+1); None = 121 (tiny: 5)
    fps: float = 24.0  # default frame rate of the video output
    max_pixels: int | None = None  # most pixels per frame a request may ask; None = 1280x704, as trained
    max_frames: int | None = None  # most frames a request may ask; None = 121, as trained
    vae_chunk_frames: int = 1  # latent frames the VAE decodes at once (memory vs speed)
    text_cache_rows: int = 16  # DiT rows whose text K/V are kept across steps (~189 MB each at 5B); 0: off

    def __post_init__(self) -> None:
        super().__post_init__()
        dtype_named(self.vae_dtype, "model_kwargs.vae_dtype")
        if self.vae_conv_dtype is not None:
            dtype_named(self.vae_conv_dtype, "model_kwargs.vae_conv_dtype")
        if self.text_cache_rows < 0:
            raise ValueError(f"wan22 text_cache_rows={self.text_cache_rows} must be >= 0 (0 turns the cache off)")
        if self.vae_chunk_frames < 1:
            raise ValueError(f"wan22 vae_chunk_frames={self.vae_chunk_frames} must be >= 1")
        positive_bounds(self, "wan22")

    def conv_dtype(self) -> str:
        """The dtype of the channels-last VAE decode's convolutions (`vae_conv_dtype` resolved)."""
        if self.vae_conv_dtype is not None:
            return self.vae_conv_dtype
        return "float16" if self.vae_dtype == "float32" else self.vae_dtype


def _graph() -> ModelGraph:
    text = Node("text_encoder", inputs=("prompt_ids", "prompt_mask", "negative_ids", "negative_mask"),
                outputs=("prompt_embeds", "negative_embeds"))
    image = Node("vae", name="encode_image", inputs=("image",), outputs=("condition",))
    prepare = Node("scheduler", name="prepare", inputs=("condition",), outputs=("latents", "dit_latents", "timestep"))
    branch = {"latents": "dit_latents", "timestep": "timestep"}
    cond = Node("dit", name="cond", inputs={**branch, "context": "prompt_embeds"}, outputs={"velocity": "cond_velocity"})
    uncond = Node("dit", name="uncond", inputs={**branch, "context": "negative_embeds"},
                  outputs={"velocity": "uncond_velocity"})
    combine = Node("scheduler", name="combine", inputs=("cond_velocity", "uncond_velocity", "latents", "condition"),
                   outputs=("latents", "dit_latents", "timestep", "progress", "step_latents"))
    steps = Loop(Sequential(Parallel(cond, uncond), combine), max_iterations="num_inference_steps", name="steps")
    decode = Node("vae", name="decode", inputs=("latents",), outputs=("video", "image", "frames", "progress"))
    return ModelGraph(
        components={
            "text_encoder": ComponentSpec("stateless", "UMT5: prompt and negative prompt ids -> text embeddings"),
            "dit": ComponentSpec("stateless", "video DiT: (latents, per-frame timesteps, text) -> flow velocity",
                                 sequence_parallel=True),
            "scheduler": ComponentSpec("stateless", "per-request noise and UniPC state; guidance + one step"),
            "vae": ComponentSpec("stateless", "Wan2.2 VAE: reference image -> latent frame; latents -> frames"),
        },
        walks=(
            Walk("encode_text", "video", text, inputs=("prompt_ids", "prompt_mask"),
                 optional_inputs=("negative_ids", "negative_mask"),
                 emits=(Emit("prompt_embeds", CARRY), Emit("negative_embeds", CARRY))),
            Walk("encode_image", "video", image, inputs=("image",), emits=(Emit("condition", CARRY),)),
            Walk("denoise", "video", Sequential(prepare, steps), inputs=("prompt_embeds",),
                 optional_inputs=("negative_embeds", "condition"),
                 emits=(Emit("progress"), Emit("step_latents"), Emit("latents", CARRY))),
            Walk("decode", "video", decode, inputs=("latents",),
                 emits=(Emit("video"), Emit("image"), Emit("frames"), Emit("progress"))),
        ),
        lanes=(Lane("video", "encode_text", _next_walk),),
    )


def _next_walk(finished: str, options: Mapping[str, Any]) -> str | None:
    if finished == "encode_text":
        return "encode_image" if options.get("image_to_video") else "denoise"
    return {"encode_image": "denoise", "denoise": "decode"}.get(finished)


class Wan22Model(Model):
    """Wan2.2-TI2V-5B from a Diffusers folder (--model-path), dummy weights, or --tiny."""

    name = "wan22"
    input_modalities = ("text", "image")
    output_modalities = ("video", "image")
    default_options = {"negative_prompt": "", "guidance_scale": 5.0, "num_inference_steps": 50,
                       "modalities": ["video"], "report_progress": False, "debug_outputs": False}
    extra_options = GENERATION_OPTIONS

    config_class = Wan22ServeConfig
    quantizable = ("dit",)  # the blocks' attention and FFN linears (transformer.build_transformer says which stay)

    def graph(self) -> ModelGraph:
        return _graph()

    def build_component(self, name: str, device: torch.device) -> BuiltComponent:
        from mstar.models.wan22 import components, loaders

        if name == "text_encoder":
            encoder = loaders.text_encoder(self, self._dtype(device), device)
            return BuiltComponent(components.TextEncoderComponent(encoder, self._dtype(device)))
        if name == "dit":
            transformer = loaders.transformer(self, self._dtype(device), device)
            dit = components.DiTComponent(transformer, self.config.text_cache_rows)
            return BuiltComponent(dit, StatelessSpec(max_batch_size=DIT_BATCH))
        if name == "scheduler":
            from mstar.models.wan22.combine import GuidanceScheduler

            return BuiltComponent(GuidanceScheduler(self.components.scheduler, self.vae_config, device))
        if name == "vae":
            from mstar.models.common.wan_vae.component import VAEComponent
            from mstar.models.common.wan_vae.vae_weights import load_deployment_vae

            vae = load_deployment_vae(self.checkpoint, self.vae_config, self.load_format,
                                      DTYPES[self.config.vae_dtype], device, self.config.seed)
            vae.conv_dtype = DTYPES[self.config.conv_dtype()]
            return BuiltComponent(VAEComponent(vae, self.config.vae_chunk_frames))
        raise KeyError(f"wan22 has no component {name!r}; components are {sorted(self.graph().components)}")

    def processor(self):
        from mstar.models.wan22.processor import Wan22Processor, defaults_for

        return Wan22Processor(self.tokenizer_folder, self.text_length, defaults_for(self.config))

    # -- what the loaders and the processor read -------------------------------------------------

    @cached_property
    def checkpoint(self) -> Path | None:
        """The Diffusers folder, or None for random weights (tiny, or --load-format dummy)."""
        from mstar.models.common.loading import deployment_checkpoint

        return deployment_checkpoint(self.model_path, self.config.tiny, self.load_format, "wan22",
                                     "a Diffusers Wan2.2-TI2V-5B folder or the repo id Wan-AI/Wan2.2-TI2V-5B-Diffusers")

    @cached_property
    def components(self) -> Wan22Config:
        """Configs of the text encoder, DiT and scheduler."""
        if self.checkpoint is not None:
            return Wan22Config.from_folder(self.checkpoint)
        if self.config.tiny:
            from mstar.models.wan22.tiny import tiny_config

            return tiny_config()
        return Wan22Config()

    @cached_property
    def vae_config(self) -> WanVAEConfig:
        """The VAE's config; its latent channels must be the DiT's."""
        from mstar.models.common.wan_vae.vae_weights import deployment_vae_config

        return deployment_vae_config(self.checkpoint, self.config.tiny, self.components.transformer.in_channels,
                                     "Wan2.2")

    @property
    def text_length(self) -> int:
        """Tokens every prompt is padded or truncated to."""
        if self.config.text_length is not None:
            return self.config.text_length
        return 16 if self.config.tiny else self.components.text_length

    @cached_property
    def tokenizer_folder(self) -> Path:
        """The checkpoint's tokenizer/ folder, else the tiny tokenizer (fine for random weights only)."""
        from mstar.models.wan22.tiny import tiny_tokenizer_folder

        if self.checkpoint is not None and (self.checkpoint / "tokenizer" / "tokenizer.json").is_file():
            return self.checkpoint / "tokenizer"
        return tiny_tokenizer_folder()

    def _dtype(self, device: torch.device) -> torch.dtype:
        return self.config.torch_dtype(device)
