"""BAGEL requests <-> tensors: text and images in order to a context plan, options resolved; text and images out.

A request is a chat (`messages`: every text part and every image part, in order, any role) or a prompt
(`text`, after its `media` images, as the upstream inferencer orders them). A chat's `tools`, assistant tool
calls and tool results become text parts written as the tokenizer's ChatML template writes them (Hermes
`<tool_call>`s); option `structured_outputs` constrains a text answer (models/bagel/components.py). Option `modalities` says
what comes out: ["text"] (an answer), ["image"] (generation; an edit when the request has images),
["text", "image"] (a thought, then the image it plans). Option `think` adds the thinking system
prompt to a text answer too.

Images are resized as the upstream inferencer does: first to the VAE's range (long side at most 1024,
short at least 512, both multiples of 16: the size of an edit's output), then from that to the ViT's
(980 / 224 / 14). A text answer reads images through the ViT only; image output also puts them in the
context through the VAE. A context (its text and image tokens) and the answer's `max_tokens` must fit
the model's 32,768 positions. Walk inputs: `prompt_ids` (every text segment's ids, markers included),
`segments` (plan.py), `token` (the first token a text answer is fed), and when there are images
`vit_patches`, `vit_positions`, `vit_lengths` and `vae_pixels`. Pixels leave as uint8 (`vit_patches` in
`patchify`'s layout, `vae_pixels` each image's [3, H, W] flattened), a quarter of float32's bytes to the
worker; the ViT and VAE components map them to [-1, 1] on their device (`embeddings.unit_pixels`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mstar.models.bagel.config import BagelConfig, TokenIds
from mstar.models.bagel.embeddings import grid_positions, pixel_patches
from mstar.models.bagel.flow import RENORM_TYPES
from mstar.models.bagel.model import KV_PAGE_SIZE, request_pages
from mstar.models.bagel.plan import (
    TEXT,
    VAE,
    VIT,
    Segment,
    branch_masks,
    decode_segments,
    encode_segments,
    extent,
)
from mstar.models.common.text import Tokenizer
from mstar.models.common.video_options import integer, number, seed, video_size
from mstar.models.llama.processor import TextProcessor

# The system prompts BAGEL was trained to think under (the upstream inferencer's).
VLM_THINK_PROMPT = ("You should first think about the reasoning process in the mind and then provide the user with "
                    "the answer. \nThe reasoning process is enclosed within <think> </think> tags, i.e. <think> "
                    "reasoning process here </think> answer here")
GEN_THINK_PROMPT = ("You should first think about the planning process in the mind and then generate the image. \n"
                    "The planning process is enclosed within <think> </think> tags, i.e. <think> planning process "
                    "here </think> image here")
MAX_STEPS = 200  # four times the default 50; each step is a forward over the whole context
_TURN = re.compile(r"<\|im_start\|>[a-z]+\n?(.*?)<\|im_end\|>", re.DOTALL)  # a ChatML turn's body


@dataclass(frozen=True)
class Resize:
    """The upstream `MaxLongEdgeMinShortEdgeResize`: sides within [min_size, max_size], multiples of `stride`."""

    max_size: int
    min_size: int
    stride: int
    max_pixels: int = 14 * 14 * 9 * 1024

    def size(self, width: int, height: int) -> tuple[int, int]:
        scale = max(min(self.max_size / max(width, height), 1.0), self.min_size / min(width, height))
        width, height = self._scaled(width, height, scale)
        if width * height > self.max_pixels:
            width, height = self._scaled(width, height, self.max_pixels / (width * height))
        if max(width, height) > self.max_size:
            width, height = self._scaled(width, height, self.max_size / max(width, height))
        return width, height

    def _scaled(self, width: int, height: int, scale: float) -> tuple[int, int]:
        def divisible(value: int) -> int:
            return max(self.stride, int(round(value / self.stride) * self.stride))

        return divisible(round(width * scale)), divisible(round(height * scale))


@dataclass(frozen=True)
class BagelDefaults:
    """Request defaults and image ranges that depend on the deployment (full size or tiny)."""

    width: int
    height: int
    max_side: int  # the largest image side the latent position grid covers
    vae: Resize
    vit: Resize


def defaults_for(config: Any, cfg: BagelConfig | None = None) -> BagelDefaults:
    """The defaults of a BagelServeConfig: 1024x1024 images at full size, 64x64 when tiny."""
    if config.tiny:
        width, height, vae, vit = 64, 64, Resize(128, 32, 16), Resize(112, 28, 14)
    else:
        width, height, vae, vit = 1024, 1024, Resize(1024, 512, 16), Resize(980, 224, 14)
    max_side = (cfg.max_latent_size * cfg.latent_downsample) if cfg is not None else vae.max_size
    return BagelDefaults(config.width or width, config.height or height, max_side, vae, vit)


def resolve_options(options: Mapping[str, Any], defaults: BagelDefaults, edit: bool = False) -> dict[str, Any]:
    """The resolved outputs, image size, schedule, guidance and seed of a request; ValueError names a bad one.
    An edit (input images, image out) defaults to the upstream editing settings."""
    modalities = list(options.get("modalities") or ["text"])
    if not modalities or not set(modalities) <= {"text", "image"}:
        raise ValueError(f"modalities={modalities!r}: bagel makes 'text', 'image' or both (a thought, then the image)")
    image = "image" in modalities
    width, height = video_size(options, defaults.width, defaults.height, 16, defaults.max_side)
    interval = options.get("cfg_interval")
    interval = ([0.0, 1.0] if edit else [0.4, 1.0]) if interval is None else interval
    if not (isinstance(interval, list | tuple) and len(interval) == 2
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in interval)
            and 0.0 <= interval[0] <= interval[1] <= 1.0):
        raise ValueError(f"cfg_interval={interval!r}: use [lo, hi] with 0 <= lo <= hi <= 1 (guided where lo < t <= hi)")
    renorm = options.get("cfg_renorm_type") or ("text_channel" if edit else "global")
    if renorm not in RENORM_TYPES:
        raise ValueError(f"cfg_renorm_type={renorm!r}: use one of {list(RENORM_TYPES)}")
    image_scale = options.get("image_guidance_scale")
    max_tokens = options.get("max_tokens")
    if max_tokens is not None:
        integer(max_tokens, "max_tokens", 1, 1 << 20)
    return {
        "image_output": image, "think": bool(options.get("think")) or (image and "text" in modalities),
        "width": width, "height": height,
        "num_inference_steps": integer(options.get("num_inference_steps", 50), "num_inference_steps", 2, MAX_STEPS),
        "guidance_scale": number(options.get("guidance_scale", 4.0), "guidance_scale", 0.0, 100.0),
        "image_guidance_scale": number((2.0 if edit else 1.5) if image_scale is None else image_scale,
                                       "image_guidance_scale", 0.0, 100.0),
        "cfg_interval": [float(interval[0]), float(interval[1])], "cfg_renorm_type": renorm,
        "cfg_renorm_min": number(options.get("cfg_renorm_min", 0.0), "cfg_renorm_min", 0.0, 1.0),
        "timestep_shift": number(options.get("timestep_shift", 3.0), "timestep_shift", 0.01, 100.0),
        "seed": seed(options),
    }


class BagelProcessor(TextProcessor):
    """Chat or prompt (+ images) -> the context plan and its pieces; text through `TextDecoder`, images as
    uint8 [H, W, 3]."""

    def __init__(self, tokenizer: Tokenizer, cfg: BagelConfig, defaults: BagelDefaults,
                 max_model_len: int = 32768, grammars: Any = None, kv_pages: int | None = None) -> None:
        super().__init__(tokenizer, max_model_len, grammars)
        self.cfg, self.defaults = cfg, defaults
        self.kv_pages = kv_pages  # pages of the LLM's KV pool (model_kwargs.kv_tokens); None: unchecked
        self.ids = TokenIds.from_tokenizer(tokenizer)

    def validate_options(self, options: Mapping[str, Any]) -> None:
        super().validate_options(options)
        resolved = resolve_options(options, self.defaults)
        if options.get("structured_outputs") is not None and resolved["think"]:
            raise ValueError("structured_outputs constrain a text answer from its first token: ask for modalities "
                             "['text'] without think (a thought follows no grammar)")

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Walk inputs (module docstring); writes the resolved options into `options`, with the latent grid
        (`latent_rows`, `latent_cols`), `has_images` and `no_image_context` (the no-image guidance context
        differs from the full one)."""
        items = _items(self._with_tools(request))
        images = [x for kind, x in items if kind == "image"]
        image_out = "image" in (options.get("modalities") or ["text"])
        options.update(resolve_options(options, self.defaults, edit=bool(images) and image_out))
        resized = [self._resize(x, self.defaults.vae) for x in images]
        if images and image_out:  # an edit's output takes its (last) input image's size
            options["height"], options["width"] = resized[-1].shape[:2]
        step = self.cfg.latent_downsample
        options["latent_rows"], options["latent_cols"] = options["height"] // step, options["width"] // step
        options["has_images"] = bool(images)
        options["no_image_context"] = bool(images) or options["think"]
        if options["think"]:
            items = [("text", GEN_THINK_PROMPT if image_out else VLM_THINK_PROMPT), *items]
        out = self._plan(items, iter(resized), image_out, options["think"], options.get("max_tokens"))
        self._check_pool(decode_segments(out["segments"]), options)
        return out

    def _check_pool(self, segments: list[Segment], options: Mapping[str, Any]) -> None:
        """Refuse a request whose contexts (counted as on one worker, the default placement) no KV pool of
        this size holds; one that fits waits in the LLM's engine while others hold the pages."""
        if self.kv_pages is None:
            return
        pages = request_pages(segments, options, KV_PAGE_SIZE)
        if pages > self.kv_pages:
            raise ValueError(f"this request's contexts take {pages * KV_PAGE_SIZE} tokens of the LLM's KV pool "
                             f"(prompt, images, max_tokens and guidance contexts), more than it holds "
                             f"({self.kv_pages * KV_PAGE_SIZE}, model_kwargs.kv_tokens); shorten it or lower "
                             "max_tokens")

    def _with_tools(self, request: Mapping[str, Any]) -> Mapping[str, Any]:
        """The chat with its `tools` and tool turns (assistant calls, tool results) as plain text messages, each
        the body of the turn the tokenizer's ChatML template writes for it: BAGEL reads every text as one
        <|im_start|> .. <|im_end|> segment, without roles."""
        tools, messages = request.get("tools"), list(request.get("messages") or ())
        if not tools and not any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
            return request
        if self.tool_format is None:
            raise ValueError("this bagel tokenizer has no chat template that writes tool calls; leave tools out")
        out = []
        if tools:
            system = messages[0].get("role") == "system"
            head = messages[:1] if system else [{"role": "user", "content": ""}]
            out.append({"role": "system", "content": self._turns(head, tools)[0]})
            messages = messages[1:] if system else messages
        for m in messages:
            tool_turn = m.get("role") == "tool" or m.get("tool_calls")
            out.append({"role": m["role"], "content": self._turns([m], None)[-1]} if tool_turn else m)
        return {**request, "messages": out}

    def _turns(self, messages: list[Mapping[str, Any]], tools: Any) -> list[str]:
        return _TURN.findall(self.tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=tools))

    def _plan(self, items: list[tuple[str, Any]], resized, image_out: bool, think: bool,
              max_tokens: int | None) -> dict[str, torch.Tensor]:
        kinds, segments, text, vit, vae = [], [], [], [], []
        for kind, value in items:
            if kind == "text":
                encoded = self.tokenizer.encode(value, add_special_tokens=False, max_tokens=self.max_model_len)
                ids = [self.ids.bos, *encoded, self.ids.eos]
                text += ids
                kinds.append(TEXT)
                segments.append((TEXT, len(ids), 0, 0))
                continue
            image = next(resized)
            if image_out:
                vae.append(_channels_first(image))
                rows, cols = image.shape[0] // self.cfg.latent_downsample, image.shape[1] // self.cfg.latent_downsample
                kinds.append(VAE)
                segments.append((VAE, rows * cols, rows, cols))
            vit_image = self._resize(image, self.defaults.vit)
            p = self.cfg.vit.patch_size
            rows, cols = vit_image.shape[0] // p, vit_image.shape[1] // p
            vit.append((pixel_patches(vit_image, p), grid_positions(rows, cols, self.cfg.vit_max_patches_per_side)))
            kinds.append(VIT)
            segments.append((VIT, rows * cols, rows, cols))
        masks = branch_masks(kinds, think)
        plan = [Segment(k, m, n, r, c) for (k, n, r, c), m in zip(segments, masks, strict=True)]
        self._check_length(extent(plan)[0], max_tokens)
        out = {"prompt_ids": torch.tensor(text, dtype=torch.long), "segments": encode_segments(plan),
               "token": torch.tensor([self.ids.bos], dtype=torch.long)}
        if vit:
            out["vit_patches"] = torch.cat([v[0] for v in vit])
            out["vit_positions"] = torch.cat([v[1] for v in vit])
            out["vit_lengths"] = torch.tensor([v[0].shape[0] for v in vit], dtype=torch.long)
        if vae:
            out["vae_pixels"] = torch.cat([v.flatten() for v in vae])
        return out

    def _resize(self, image: np.ndarray, resize: Resize) -> np.ndarray:
        from PIL import Image

        height, width = image.shape[:2]
        size = resize.size(width, height)
        if size == (width, height):
            return image
        return np.asarray(Image.fromarray(image).resize(size, resample=Image.Resampling.BICUBIC))

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        if name == "progress":
            return float(tensor.reshape(-1)[0])
        return super().decode_output(name, tensor, options)


def _channels_first(image: np.ndarray) -> torch.Tensor:
    """uint8 [H, W, 3] -> uint8 [3, H, W], a fresh copy."""
    return torch.from_numpy(np.array(image.transpose(2, 0, 1), order="C"))


def _items(request: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """("text", str) and ("image", uint8 [H, W, 3]) in context order."""
    media = list(request.get("media") or ())
    for m in media:
        if m.get("type") != "image":
            raise ValueError(f"bagel reads text and images; got a {m.get('type')!r} part")
        if m.get("name") == "mask":
            raise ValueError("bagel edits the whole image and takes no mask; leave the mask out")
    images = iter([_rgb(m["data"]) for m in media])
    items: list[tuple[str, Any]] = []
    if request.get("messages"):
        for message in request["messages"]:
            content = message.get("content") or ""
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for part in parts:
                if part.get("type") == "text":
                    if part.get("text"):
                        items.append(("text", part["text"]))
                elif part.get("type") in ("image_url", "image"):
                    image = next(images, None)
                    if image is None:
                        raise ValueError("a chat image part has no decoded image")
                    items.append(("image", image))
                else:
                    raise ValueError(f"bagel reads text and image parts; got a {part.get('type')!r} part")
        if next(images, None) is not None:
            raise ValueError("more images than image parts in the messages")
    else:
        items = [("image", x) for x in images]
        text = request.get("text")
        if isinstance(text, str) and text:
            items.append(("text", text))
    if not items:
        raise ValueError("bagel needs a prompt: non-empty 'messages', or 'text' and/or images")
    return items


def _rgb(image: Any) -> np.ndarray:
    array = np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] not in (3, 4):
        raise ValueError(f"an image must be uint8 [H, W, 3], got {array.dtype} {array.shape}")
    return np.ascontiguousarray(array[..., :3])
