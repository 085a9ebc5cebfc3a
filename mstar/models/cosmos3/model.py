"""Cosmos3 (Nano, Super) and Cosmos3 Policy DROID: text, an image or camera video to images, videos
and robot actions, as served models.

Lane `generate` (image, video and action outputs):  [encode_image] -> denoise -> [decode]
  encode_image  image-to-video and policy requests: the VAE encodes the conditioning frame as the
                first latent frame; carried on.
  denoise       `prepare` draws the request's noise (its own generator) and opens its UniPC states;
                then a Loop over the request's steps of Sequential(Parallel(cond DiT, uncond DiT),
                combine): guidance plus one UniPC step per generated modality (video, actions),
                stopping when the schedule is done and emitting a policy's action chunk. The DiT runs
                the prompt through its understanding tower once per branch and every step through its
                generation tower (on CUDA replayed from graphs at the `graph_sizes` token counts);
                requests at different steps share forwards, and the branches batch on one device or
                sit on two ranks (placement by node name) with the same graph.
  decode        the VAE turns the final latents into uint8 frames, when images or video are asked for.
Lane `chat` (text output; cosmos3 only):  prefill -> decode
  the reasoner (the understanding tower with its head, a Qwen3 decoder on the autoregressive engine)
  answers the chat, as the dense decoders of models/llama do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from mstar.engines.base import AutoregressiveSpec, StatelessSpec
from mstar.engines.sampling import SAMPLING_OPTIONS
from mstar.graph import CARRY, ComponentSpec, Emit, Lane, Loop, ModelGraph, Node, Parallel, Sequential, Walk
from mstar.models.base import BuiltComponent, Model
from mstar.models.common.serve_config import DTYPES, ServeConfig, decode_steps, dtype_named
from mstar.models.common.video_options import GENERATION_OPTIONS, deployment_limits, positive_bounds
from mstar.models.common.wan_vae.vae_config import WanVAEConfig
from mstar.models.cosmos3.config import Cosmos3Config
from mstar.models.cosmos3.options import LIMITS, Cosmos3Defaults, PolicyDefaults
from mstar.models.llama.processor import TEXT_OPTIONS

DIT_BATCH = 16  # DiT rows (requests x guidance branches) per forward
_TINY_STD = 0.3  # tiny random weights large enough that prompts and steps visibly change the output


@dataclass(frozen=True)
class Cosmos3ServeConfig(ServeConfig):
    """How one deployment runs Cosmos3 (YAML `model_kwargs`); request defaults live in options.py.
    `dtype` is the DiT's (None: float32 on CPU or tiny, else bfloat16)."""

    tiny_in_float32 = True
    vae_dtype: str = "float32"
    width: int | None = None  # default output size; None = 1280x720 (tiny: 64x64)
    height: int | None = None
    num_frames: int | None = None  # default frame count (4k+1); None = 189 (tiny: 5)
    max_pixels: int | None = None  # most pixels per frame a request may ask; None = 1280x720 (the 720p tier)
    max_frames: int | None = None  # most frames a request may ask; None = 189
    fps: float | None = None  # default frame rate; None = 24 (policy: 15)
    vae_chunk_frames: int = 1  # latent frames the VAE decodes at once (memory vs speed)
    max_model_len: int | None = None  # the reasoner's context (prompt and answer); None: 32768 (tiny: 2048)
    reasoner: bool = True  # answer chat with the reasoner (a second copy of the understanding tower, a KV pool)
    tokenizer_path: str | None = None  # a tokenizer folder; None: the checkpoint's text_tokenizer/
    # image sizes "WxH" whose denoising steps replay CUDA graphs on CUDA (any request of as many latent
    # tokens shares them: the transposed size, a short video); [] none; None: the model's `graph_sizes`
    graph_sizes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        dtype_named(self.vae_dtype, "model_kwargs.vae_dtype")
        if self.vae_chunk_frames < 1:
            raise ValueError(f"cosmos3 vae_chunk_frames={self.vae_chunk_frames} must be >= 1")
        positive_bounds(self, "cosmos3")
        if self.graph_sizes is not None:
            if isinstance(self.graph_sizes, str):
                raise ValueError(f"cosmos3 model_kwargs.graph_sizes={self.graph_sizes!r} must be a list of 'WxH'")
            object.__setattr__(self, "graph_sizes", tuple(self.graph_sizes))
            graph_pixels(self.graph_sizes)  # raises on a bad size


def graph_pixels(sizes: Sequence[str]) -> list[tuple[int, int]]:
    """(width, height) of each of `sizes` ("WxH"); a bad one raises ValueError naming it."""
    from mstar.models.common.video_options import video_size

    pixels = []
    for size in sizes:
        try:
            pixels.append(video_size({"size": size}, 0, 0, LIMITS.multiple, LIMITS.max_side))
        except ValueError as exc:
            raise ValueError(f"cosmos3 model_kwargs.graph_sizes entry {size!r}: {exc}") from None
    return pixels


def _graph(chat_context: int | None, sound: bool) -> ModelGraph:
    """The generate lane (with `sound`, its decode walk also decodes sound), and with `chat_context` (the
    reasoner's context length) the chat lane."""
    components = {
        "dit": ComponentSpec("stateless", "MoT generator: (prompt ids, noisy latents, timestep) -> velocities",
                             sequence_parallel=True),
        "scheduler": ComponentSpec("stateless", "per-request noise and UniPC states; guidance + one step"),
        "vae": ComponentSpec("stateless", "Wan2.2 VAE: conditioning frame -> latent frame; latents -> frames"),
    }
    if sound:
        components["sound_decoder"] = ComponentSpec("stateless", "AVAE audio decoder: sound latents -> waveform")
    if chat_context:
        components["reasoner"] = ComponentSpec("autoregressive", "the reasoner: token ids -> next token (paged KV)")
    image = Node("vae", name="encode_image", inputs=("image",), outputs=("condition",))
    chat_walks, chat_lanes = _chat(chat_context) if chat_context else ((), ())
    return ModelGraph(
        components=components,
        walks=(Walk("encode_image", "generate", image, inputs=("image",), emits=(Emit("condition", CARRY),)),
               _denoise(sound), _decode(sound), *chat_walks),
        lanes=(Lane("generate", _first_walk, _next_walk), *chat_lanes),
    )


def _denoise(sound: bool) -> Walk:
    """prepare, then a Loop over the steps of Parallel(cond, uncond) DiT branches and the combine."""
    prepare = Node("scheduler", name="prepare", inputs=("condition",),
                   outputs=("latents", "sound_latents", "action_latents", "timestep"))
    state = {e: e for e in ("latents", "timestep", "sound_latents", "action_latents")}
    velocities = ("velocity", "sound_velocity", "action_velocity")
    cond = Node("dit", name="cond", inputs={**state, "prompt_ids": "prompt_ids"},
                outputs=dict(zip(velocities, ("cond_velocity", "cond_sound", "cond_action"), strict=True)))
    uncond = Node("dit", name="uncond", inputs={**state, "prompt_ids": "negative_ids"},
                  outputs=dict(zip(velocities, ("uncond_velocity", "uncond_sound", "uncond_action"), strict=True)))
    combine = Node("scheduler", name="combine",
                   inputs=("cond_velocity", "uncond_velocity", "cond_sound", "uncond_sound", "cond_action",
                           "uncond_action", "latents", "sound_latents", "action_latents"),
                   outputs=("latents", "sound_latents", "action_latents", "timestep", "progress", "step_latents",
                            "actions"))
    steps = Loop(Sequential(Parallel(cond, uncond), combine), max_iterations="num_inference_steps", name="steps")
    carried = (Emit("latents", CARRY), *((Emit("sound_latents", CARRY),) if sound else ()))
    return Walk("denoise", "generate", Sequential(prepare, steps), inputs=("prompt_ids",),
                optional_inputs=("negative_ids", "condition"),
                emits=(Emit("progress"), Emit("step_latents"), Emit("actions"), *carried))


def _decode(sound: bool) -> Walk:
    """The VAE's frames, and with `sound` the sound decoder's waveform beside them."""
    frames = Node("vae", name="decode", inputs=("latents",), outputs=("video", "image", "frames", "progress"))
    emits = (Emit("video"), Emit("image"), Emit("frames"), Emit("progress"))
    if not sound:
        return Walk("decode", "generate", frames, inputs=("latents",), emits=emits)
    waves = Node("sound_decoder", name="sound", inputs=("sound_latents",), outputs=("audio",))
    return Walk("decode", "generate", Parallel(frames, waves), inputs=("latents",), optional_inputs=("sound_latents",),
                emits=(*emits, Emit("audio")))


def _chat(context: int) -> tuple[tuple[Walk, ...], tuple[Lane, ...]]:
    """The chat lane's prefill and decode walks over the reasoner (as the dense decoders' `lm_graph`)."""
    from mstar.models.llama.processor import LOGPROB_OUTPUTS

    sampled = {"token": "token", **{name: name for name in LOGPROB_OUTPUTS}}  # logprobs only when asked
    prefill = Node("reasoner", inputs={"input_ids": "prompt_ids"}, outputs=sampled)
    decode = Node("reasoner", inputs={"input_ids": "token", "prompt_ids": "prompt_ids"}, outputs=sampled)
    logprobs = tuple(Emit(name, name=name) for name in LOGPROB_OUTPUTS)
    walks = (Walk("chat_prefill", "chat", prefill, inputs=("prompt_ids",),
                  emits=(Emit("token", name="text"), *logprobs, Emit("token", CARRY))),
             Walk("chat_decode", "chat", Loop(decode, max_iterations=decode_steps(context), name="decode"),
                  inputs=("token", "prompt_ids"), emits=(Emit("token", name="text"), *logprobs)))
    lane = Lane("chat", lambda o: "chat_prefill" if is_chat(o) else None, {"chat_prefill": "chat_decode"})
    return walks, (lane,)


def is_chat(options: Mapping[str, Any]) -> bool:
    """A request for text: the reasoner answers it."""
    return "text" in (options.get("modalities") or ())


def _first_walk(options: Mapping[str, Any]) -> str | None:
    if is_chat(options):
        return None
    return "encode_image" if options.get("condition") else "denoise"


def _next_walk(finished: str, options: Mapping[str, Any]) -> str | None:
    if finished == "encode_image":
        return "denoise"
    if finished == "denoise" and {"image", "video", "audio"} & set(options.get("modalities") or ["video"]):
        return "decode"
    return None


class Cosmos3Model(Model):
    """Cosmos3-Nano (or Super, by --model-path) from a Diffusers folder, dummy weights, or --tiny."""

    name = "cosmos3"
    input_modalities = ("text", "image", "video")
    output_modalities = ("video", "image", "audio", "actions", "text")
    default_options = {"negative_prompt": "", "modalities": ["video"], "report_progress": False,
                       "debug_outputs": False}
    # a generation's, a policy's (options.resolve_policy) and the reasoner's chat (a text model's)
    extra_options = (GENERATION_OPTIONS | {"embodiment", "resolution_tier", "view_point", "chunk_size"}
                     | SAMPLING_OPTIONS | TEXT_OPTIONS)
    _repo = "nvidia/Cosmos3-Nano"
    context_component = "reasoner"  # bounds chat prompts and answers (absent without the reasoner: no chat)

    config_class = Cosmos3ServeConfig

    has_reasoner = True  # the checkpoint's reasoner can answer text requests
    # image sizes whose denoising steps replay CUDA graphs unless model_kwargs.graph_sizes says otherwise: the
    # small ones, where a step's kernel launches take longer than its GPU work
    graph_sizes: tuple[str, ...] = ("320x192", "832x480")

    @property
    def chat(self) -> bool:
        """Whether this deployment answers text requests (the reasoner is built)."""
        return self.has_reasoner and self.config.reasoner

    def graph(self) -> ModelGraph:
        return _graph(self.max_model_len if self.chat else None, sound=self.has_reasoner)

    def build_component(self, name: str, device: torch.device) -> BuiltComponent:
        from mstar.models.cosmos3 import components, loaders

        if name == "dit":
            generator = loaders.generator(self, self._dtype(device), device)
            spec = self.engine_spec(name, StatelessSpec(max_batch_size=DIT_BATCH, cuda_graph_sizes=components.GRAPH_ROWS))
            dit = components.GeneratorComponent(generator, self.vae_config.scale_factor_temporal, self.graph_tokens,
                                                max(spec.graph_sizes()))
            return BuiltComponent(dit, replace(spec, graph_buffers=dit.graph_buffers()))
        if name == "scheduler":
            from mstar.models.cosmos3.guidance import GuidanceScheduler

            return BuiltComponent(GuidanceScheduler(self.components.scheduler, device))
        if name == "vae":
            from mstar.models.common.wan_vae.vae_weights import load_deployment_vae

            vae = load_deployment_vae(self.checkpoint, self.vae_config, self.load_format,
                                      DTYPES[self.config.vae_dtype], device, self.config.seed)
            return BuiltComponent(components.Cosmos3VAEComponent(vae, self.config.vae_chunk_frames))
        if name == "reasoner" and self.chat:
            return self._reasoner(device)
        if name == "sound_decoder" and self.has_reasoner:
            from mstar.models.cosmos3.sound import SoundComponent, load_sound_decoder

            folder = None if self.checkpoint is None else self.checkpoint / "sound_tokenizer"
            decoder = None if self.sound_config is None else load_sound_decoder(
                folder, self.sound_config, self.load_format, device, self.config.seed)
            return BuiltComponent(SoundComponent(decoder))
        raise KeyError(f"{self.name} has no component {name!r}; components are {sorted(self.graph().components)}")

    def processor(self):
        from mstar.models.cosmos3.processor import Cosmos3Processor, ModelShape

        t, v = self.components.transformer, self.vae_config
        shape = ModelShape(t.latent_channel, v.scale_factor_spatial, v.scale_factor_temporal, t.action_dim,
                           self.components.flags.use_system_prompt, t.sound_dim, self.sound_config)
        return Cosmos3Processor(self.tokenizer_folder, shape, self.request_defaults(),
                                self.max_model_len if self.chat else None)

    @property
    def graph_tokens(self) -> list[int]:
        """Generated tokens of an image of each of the deployment's `graph_sizes` (else the model's): the rows
        the DiT's step graphs hold."""
        sizes = self.graph_sizes if self.config.graph_sizes is None else self.config.graph_sizes
        s, p = self.vae_config.scale_factor_spatial, self.components.transformer.latent_patch_size
        return [-(-(height // s) // p) * -(-(width // s) // p) for width, height in graph_pixels(sizes)]

    @cached_property
    def sound_config(self):
        """The sound decoder's config (a SoundConfig), None when the checkpoint makes no sound."""
        from mstar.models.cosmos3.sound import SoundConfig

        if not self.has_reasoner or self.components.transformer.sound_dim is None:
            return None
        if self.checkpoint is not None:
            path = self.checkpoint / "sound_tokenizer" / "config.json"
            return SoundConfig.from_hf(json.loads(path.read_text())) if path.is_file() else None
        if self.config.tiny:
            from mstar.models.cosmos3.tiny import TINY_SOUND

            return SoundConfig.from_hf(TINY_SOUND)
        return SoundConfig(latent_dim=self.components.transformer.sound_dim)

    @property
    def max_model_len(self) -> int:
        """The reasoner's context: prompt and answer tokens."""
        return self.config.max_model_len or (2048 if self.config.tiny else 32768)

    def _reasoner(self, device: torch.device) -> BuiltComponent:
        from mstar.models.common.text import Tokenizer
        from mstar.models.cosmos3.reasoner import load_reasoner, reasoner_config

        eos = Tokenizer.from_pretrained(self.tokenizer_folder).eos_token_ids
        config = reasoner_config(self.components.transformer, eos, self.max_model_len)
        folder = None if self.checkpoint is None else self.checkpoint / "transformer"
        module = load_reasoner(folder, config, self.load_format, self._dtype(device), device, self.config.seed,
                               self.tiny_std)
        return BuiltComponent(module, AutoregressiveSpec(eos_token_ids=eos, max_model_len=self.max_model_len))

    def request_defaults(self) -> Cosmos3Defaults:
        """The deployment's request defaults (full size, or 64x64x5 when tiny)."""
        c = self.config
        width, height, frames = (64, 64, 5) if c.tiny else (1280, 720, 189)
        defaults = Cosmos3Defaults(width=c.width or width, height=c.height or height,
                                   num_frames=c.num_frames or frames, fps=c.fps or 24.0, num_inference_steps=35,
                                   guidance_scale=6.0)
        return replace(defaults, limits=deployment_limits(LIMITS, c, defaults))

    # -- what the loaders and the processor read -------------------------------------------------

    @cached_property
    def checkpoint(self) -> Path | None:
        """The Diffusers folder, or None for random weights (tiny, or --load-format dummy)."""
        from mstar.models.common.loading import deployment_checkpoint

        return deployment_checkpoint(self.model_path, self.config.tiny, self.load_format, self.name,
                                     f"a Diffusers Cosmos3 folder or the repo id {self._repo}")

    @cached_property
    def components(self) -> Cosmos3Config:
        """Configs of the generator, scheduler and pipeline flags."""
        if self.checkpoint is not None:
            return Cosmos3Config.from_folder(self.checkpoint)
        if self.config.tiny:
            from mstar.models.cosmos3.tiny import tiny_config

            return tiny_config()
        return Cosmos3Config()

    @cached_property
    def vae_config(self) -> WanVAEConfig:
        """The VAE's config; its latent channels must be the generator's."""
        from mstar.models.common.wan_vae.vae_weights import deployment_vae_config

        return deployment_vae_config(self.checkpoint, self.config.tiny, self.components.transformer.latent_channel,
                                     "Cosmos3")

    @cached_property
    def tokenizer_folder(self) -> Path:
        """`tokenizer_path`, else the checkpoint's text_tokenizer/ folder, else Qwen's vocabulary built offline
        (full size) or the tiny tokenizer (tiny): the last two are fine for random weights only."""
        from mstar.models.cosmos3.tokenizer import tiny_tokenizer_folder

        if self.config.tokenizer_path is not None:
            return Path(self.config.tokenizer_path)
        if self.checkpoint is not None:
            for name in ("text_tokenizer", "tokenizer"):
                if (self.checkpoint / name / "tokenizer.json").is_file():
                    return self.checkpoint / name
        if not self.config.tiny:
            from mstar.models.common.tokenizer_build import omni_tokenizer_folder

            return omni_tokenizer_folder()  # Qwen's vocabulary and special ids, for full-size dummy weights
        return tiny_tokenizer_folder()

    @property
    def tiny_std(self) -> float:
        """Standard deviation of random weights."""
        return _TINY_STD if self.config.tiny else 0.02

    def _dtype(self, device: torch.device) -> torch.dtype:
        return self.config.torch_dtype(device)


class Cosmos3DroidModel(Cosmos3Model):
    """Cosmos3-Nano-Policy-DROID: a camera video (or image) and a task -> a DROID action chunk
    (option modalities ["actions", "video"] adds the predicted video)."""

    name = "cosmos3_droid"
    output_modalities = ("actions", "video", "image")
    default_options = {**Cosmos3Model.default_options, "modalities": ["actions"]}
    _repo = "nvidia/Cosmos3-Nano-Policy-DROID"
    has_reasoner = False
    graph_sizes = ()  # a policy row (its camera canvas and action chunk) is no image size

    def request_defaults(self) -> Cosmos3Defaults:
        """Policy defaults: the DROID embodiment, 32-step chunks at 15 fps, guidance 3."""
        base = super().request_defaults()
        return replace(base, fps=self.config.fps or 15.0, guidance_scale=3.0,
                       policy=PolicyDefaults(view_point="concat_view"))
