"""BAGEL-7B-MoT as a served model: chat about images, text to image, image editing, thinking before drawing.

Lane `main` (which walks a request takes depends on what it asks for: plan.py and `_next_walk`):
  encode          requests with images: the ViT turns them into LLM rows; for image output the VAE also
                  encodes them into latent patches (the context an edit starts from).
  prefill         text output: the `full` context (system prompt, text and images in order) into the LLM.
  prefill_guided  image output: the same, and the two guidance contexts, one node each (`full`, `no_text`,
                  `no_image`: nodes of one `llm` component that YAML may place apart by name).
  decode          text: a Loop of one token per step over the full context (the answer, or the thought).
  close           a thought before an image: its end token joins the full context.
  denoise         `prepare` draws the request's noise; a Loop over the time grid of Sequential(Parallel(full,
                  no_text, no_image), combine): each branch's LLM reads its own context (prefilled once, never
                  changed) and predicts a velocity; `combine` applies guidance and one Euler step.
  render          the VAE decodes the latents into the image.

Where this departs from the upstream inferencer, on purpose: the noise comes from a generator seeded by
the request (`seed`), an input image's latents are the VAE posterior's mean, `max_tokens` counts answer
tokens as OpenAI does (upstream's `max_length` counts the fed <|im_start|> too), and a thought joins the
image's context as the token ids generated, not decoded and tokenized again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from mstar.engines.base import KVLayout, KVPoolSpec, StatelessSpec
from mstar.engines.sampling import SAMPLING_OPTIONS
from mstar.graph import CARRY, ComponentSpec, Emit, Lane, Loop, ModelGraph, Node, Parallel, Sequential, Walk
from mstar.models.bagel.config import BagelConfig
from mstar.models.bagel.flow import branch_needed
from mstar.models.bagel.plan import BRANCHES, Segment, pages_held
from mstar.models.base import BuiltComponent, Model
from mstar.models.common.serve_config import DTYPES, ServeConfig, dtype_named
from mstar.models.llama.processor import LOGPROB_OUTPUTS, TEXT_OPTIONS

DEFAULT_MAX_TOKENS = 1024  # text tokens of an answer or a thought when a request sets no max_tokens
KV_PAGE_SIZE = 16  # tokens per page of the LLM's KV pool
DEFAULT_KV_TOKENS, TINY_KV_TOKENS = 262_144, 16_384  # `kv_tokens` when unset


@dataclass(frozen=True)
class BagelServeConfig(ServeConfig):
    """How one deployment runs BAGEL (YAML `model_kwargs`); request defaults live in the processor.
    `dtype` is the LLM's and the ViT's (None: float32 on CPU or tiny, else bfloat16)."""

    tiny_in_float32 = True
    vae_dtype: str | None = None  # the VAE's weights and compute; None: `dtype`'s
    width: int | None = None  # default image size; None = 1024x1024 (tiny: 64x64)
    height: int | None = None
    llm_batch: int = 64  # branch sequences (requests x guidance branches) per LLM forward
    # tokens the LLM's paged KV pool holds for every context of the requests in flight (prompts, images,
    # answers; a guidance branch that is a prefix of the full context shares its pages); None: 262,144
    # (14 GiB at full size in bfloat16), --tiny 16,384
    kv_tokens: int | None = None
    attention_backend: str = "auto"  # the pool's decode attention, as kv_cache.attention_backend

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vae_dtype is not None:
            dtype_named(self.vae_dtype, "model_kwargs.vae_dtype")
        if self.llm_batch < 1:
            raise ValueError(f"bagel llm_batch={self.llm_batch} must be >= 1")
        if self.kv_tokens is not None and (isinstance(self.kv_tokens, bool) or not isinstance(self.kv_tokens, int)
                                           or self.kv_tokens < KV_PAGE_SIZE):
            raise ValueError(f"bagel kv_tokens={self.kv_tokens!r} must be an integer >= {KV_PAGE_SIZE}")


def _graph() -> ModelGraph:
    vit = Node("vit", inputs=("vit_patches", "vit_positions", "vit_lengths"), outputs=("vit_embeds",))
    encode = Node("vae", name="encode", inputs=("vae_pixels", "segments"), outputs=("vae_latents",))
    context = ("prompt_ids", "segments", "vit_embeds", "vae_latents")
    prefill = {branch: Node("llm", name=branch, inputs=context) for branch in ("full", "no_text", "no_image")}
    decode = Node("llm", name="decode", inputs=("token",), outputs=("token", *LOGPROB_OUTPUTS))  # logprobs if asked
    step = {"latents": "latents", "timestep": "timestep"}
    branches = [Node("llm", name=b, inputs=step, outputs={"velocity": f"{b}_velocity"})
                for b in ("full", "no_text", "no_image")]
    combine = Node("flow", name="combine",
                   inputs=("latents", "timestep", "full_velocity", "no_text_velocity", "no_image_velocity"),
                   outputs=("latents", "timestep", "step_latents", "progress"))
    steps = Loop(Sequential(Parallel(*branches), combine), max_iterations=_euler_steps, name="steps")
    prepare = Node("flow", name="prepare", outputs=("latents", "timestep"))
    media = ("vit_embeds", "vae_latents")
    return ModelGraph(
        components={
            "vit": ComponentSpec("stateless", "SigLIP NaViT + connector: image patches -> LLM rows"),
            "vae": ComponentSpec("stateless", "FLUX VAE: input images -> latent patches; latents -> image"),
            "llm": ComponentSpec("stateless", "MoT LLM over per-branch KV contexts: prefill, decode, velocity"),
            "flow": ComponentSpec("stateless", "rectified flow: the request's noise; guidance + one Euler step"),
        },
        walks=(
            Walk("encode", "main", Parallel(vit, encode), inputs=("segments",),
                 optional_inputs=("vit_patches", "vit_positions", "vit_lengths", "vae_pixels"),
                 emits=(Emit("vit_embeds", CARRY), Emit("vae_latents", CARRY))),
            Walk("prefill", "main", prefill["full"], inputs=("prompt_ids", "segments"), optional_inputs=media),
            Walk("prefill_guided", "main", Parallel(*prefill.values()), inputs=("prompt_ids", "segments"),
                 optional_inputs=media),
            Walk("decode", "main", Loop(decode, max_iterations=_decode_steps, name="tokens"), inputs=("token",),
                 emits=(Emit("token", name="text"), *(Emit(name, name=name) for name in LOGPROB_OUTPUTS),
                        Emit("token", CARRY))),
            Walk("close", "main", Node("llm", name="close", inputs=("token",)), inputs=("token",)),
            Walk("denoise", "main", Sequential(prepare, steps),
                 emits=(Emit("progress"), Emit("step_latents"), Emit("latents", CARRY))),
            Walk("render", "main", Node("vae", name="decode", inputs=("latents",), outputs=("image", "progress")),
                 inputs=("latents",), emits=(Emit("image"), Emit("progress"))),
        ),
        lanes=(Lane("main", _first_walk, _next_walk),),
    )


def _decode_steps(options: Mapping[str, Any]) -> int:
    return int(options.get("max_tokens") or DEFAULT_MAX_TOKENS)


def answer_tokens(options: Mapping[str, Any]) -> int:
    """Tokens the full context takes beyond its prompt at most: an answer's or a thought's `max_tokens`, and a
    thought's end (its last token and <|im_end|>); none for an image drawn without thinking."""
    if options.get("image_output"):
        return _decode_steps(options) + 2 if options.get("think") else 0
    return _decode_steps(options)


def request_pages(segments: list[Segment], options: Mapping[str, Any], page_size: int) -> int:
    """Pages the LLM's contexts of one request take at most in its KV pool: the full context with its answer
    or thought, and each guidance context it keeps that is not a prefix of the full one."""
    branches = [b for b in BRANCHES if branch_needed(b, dict(options))]
    return pages_held(segments, branches, answer_tokens(options), page_size)


def _euler_steps(options: Mapping[str, Any]) -> int:
    return int(options["num_inference_steps"]) - 1  # one step per grid point but the last


def _first_walk(options: Mapping[str, Any]) -> str:
    if options.get("has_images"):
        return "encode"
    return "prefill_guided" if options.get("image_output") else "prefill"


def _next_walk(finished: str, options: Mapping[str, Any]) -> str | None:
    image, think = bool(options.get("image_output")), bool(options.get("think"))
    if finished == "encode":
        return "prefill_guided" if image else "prefill"
    if finished == "prefill_guided":
        return "decode" if think else "denoise"
    return {"prefill": "decode", "decode": "close" if image else None, "close": "denoise",
            "denoise": "render"}.get(finished)


class BagelModel(Model):
    """BAGEL-7B-MoT from its checkpoint folder (--model-path), dummy weights, or --tiny."""

    name = "bagel"
    input_modalities = ("text", "image")
    output_modalities = ("text", "image")
    default_options = {
        "modalities": ["text"], "max_tokens": None, "temperature": 0.0, "think": False,
        "num_inference_steps": 50, "guidance_scale": 4.0, "image_guidance_scale": None, "cfg_interval": None,
        "cfg_renorm_type": None, "cfg_renorm_min": 0.0, "timestep_shift": 3.0,
        "report_progress": False, "debug_outputs": False,
    }
    # the image's size (processor.resolve_options) and a text answer's sampling and decoding
    extra_options = SAMPLING_OPTIONS | TEXT_OPTIONS | {"size", "width", "height"}

    config_class = BagelServeConfig
    # the MoT decoder layers' linears of both experts (weights.build_llm says what stays)
    quantizable = ("llm",)

    def graph(self) -> ModelGraph:
        return _graph()

    def build_component(self, name: str, device: torch.device) -> BuiltComponent:
        from mstar.models.bagel import components
        from mstar.models.bagel.weights import load_part

        dtype = self.config.torch_dtype(device)
        seed, std = self.config.seed, 0.2 if self.config.tiny else 0.02
        if name == "vit":
            return BuiltComponent(components.ViTComponent(load_part("vit", self.bagel, self.checkpoint, dtype, device,
                                                                    seed, std)))
        if name == "vae":
            vae_dtype = DTYPES[self.config.vae_dtype] if self.config.vae_dtype else dtype
            vae = load_part("vae", self.bagel, self.checkpoint, vae_dtype, device, seed, std)
            return BuiltComponent(components.VAEComponent(vae, self.bagel))
        if name == "llm":
            llm = load_part("llm", self.bagel, self.checkpoint, dtype, device, seed, std,
                            quantization=self.quantization.get("llm"))
            module = components.LLMComponent(llm, self.bagel, self.token_ids, self.grammars)
            return BuiltComponent(module, StatelessSpec(max_batch_size=self.config.llm_batch,
                                                        kv_pool=self.kv_pool(dtype)))
        if name == "flow":
            return BuiltComponent(components.FlowComponent(self.bagel, device))
        raise KeyError(f"bagel has no component {name!r}; components are {sorted(self.graph().components)}")

    def kv_pool(self, dtype: torch.dtype) -> KVPoolSpec:
        """The LLM's KV pool: every context of the requests in flight, `kv_tokens` in pages."""
        llm, c = self.bagel.llm, self.config
        return KVPoolSpec(KVLayout(llm.num_layers, llm.num_kv_heads, llm.head_dim, dtype), self.kv_pages,
                          "model_kwargs.kv_tokens", KV_PAGE_SIZE, max_rows=c.llm_batch,
                          attention_backend=c.attention_backend)

    @property
    def kv_pages(self) -> int:
        """Pages of `KV_PAGE_SIZE` tokens in the LLM's KV pool (`kv_tokens`)."""
        c = self.config
        return -(-(c.kv_tokens or (TINY_KV_TOKENS if c.tiny else DEFAULT_KV_TOKENS)) // KV_PAGE_SIZE)

    def processor(self):
        from mstar.models.bagel.processor import BagelProcessor, defaults_for

        return BagelProcessor(self.tokenizer, self.bagel, defaults_for(self.config, self.bagel), grammars=self.grammars,
                              kv_pages=self.kv_pages)

    # -- what the builders and the processor read --------------------------------------------------

    @cached_property
    def checkpoint(self) -> Path | None:
        """The folder to load weights from, or None for random weights (tiny, or --load-format dummy)."""
        from mstar.models.common.loading import deployment_checkpoint

        if self.load_format == "dummy":  # random weights even with --model-path, whose configs and tokenizer apply
            return None
        return deployment_checkpoint(self.folder, self.config.tiny, self.load_format, self.name,
                                     "a folder or the repo id ByteDance-Seed/BAGEL-7B-MoT")

    @cached_property
    def folder(self) -> Path | None:
        """The checkpoint folder named by --model-path (configs and tokenizer), whatever the load format."""
        from mstar.models.common.loading import resolve_checkpoint

        return None if self.model_path is None else resolve_checkpoint(self.model_path)

    @cached_property
    def bagel(self) -> BagelConfig:
        """Every shape: the checkpoint's configs, the tiny ones, or BAGEL-7B-MoT's for dummy weights."""
        from mstar.models.bagel.tiny import TINY_MAX_LATENT, TINY_VAE, tiny_config

        if self.folder is None:
            return tiny_config() if self.config.tiny else BagelConfig()
        cfg = BagelConfig.from_folder(self.folder)
        if self.config.tiny:  # a tiny folder (tests): its VAE and latent grid are the tiny ones
            cfg = replace(cfg, vae=TINY_VAE, max_latent_size=TINY_MAX_LATENT)
        return cfg

    @cached_property
    def tokenizer(self):
        """The checkpoint's Qwen2 tokenizer; without one, the tiny tokenizer or (dummy weights) Qwen2.5's, which
        BAGEL-7B-MoT ships."""
        from mstar.models.bagel.tiny import tiny_tokenizer_folder
        from mstar.models.common.text import Tokenizer
        from mstar.models.common.tokenizer_build import cached_tokenizer_folder

        if self.folder is not None and (self.folder / "tokenizer.json").is_file():
            return Tokenizer.from_pretrained(self.folder)
        if self.folder is not None and self.load_format != "dummy":
            raise ValueError(f"no tokenizer.json in {self.folder}; bagel needs the checkpoint's tokenizer files")
        return Tokenizer.from_pretrained(tiny_tokenizer_folder() if self.config.tiny else cached_tokenizer_folder("qwen2"))

    @cached_property
    def grammars(self):
        """Structured outputs' grammars over the tokenizer, shared by the processor (which refuses a spec that
        cannot compile) and the LLM component, which masks a text answer's logits with them."""
        from mstar.models.common.grammar import XGrammars

        return XGrammars(self.tokenizer)

    @cached_property
    def token_ids(self):
        from mstar.models.bagel.config import TokenIds

        return TokenIds.from_tokenizer(self.tokenizer)
