"""Cosmos3 requests <-> tensors: prompts to token ids, conditioning frames to pixels, options resolved.

Four kinds of request (options in options.py):
- chat (modality "text"; cosmos3): messages or text for the reasoner, as the dense decoders take them;
- text to image / video: `{"text": prompt}`; with modality "audio" also the sound (when the checkpoint has a
  sound tokenizer; without one "audio" is left out, so the videos route still gets its video);
- image to video: an image in the media; it becomes the first latent frame;
- policy (modality "actions"): a camera video (its first frame conditions) or image, the task as the
  text; the answer is an action chunk [chunk_size, action width] (and, with modality "video", the
  predicted video).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mstar.models.base import OutputDecoder, Processor
from mstar.models.common.video_options import request_text
from mstar.models.cosmos3 import actions, prompts
from mstar.models.cosmos3.guidance import Layout
from mstar.models.cosmos3.options import Cosmos3Defaults, Generation, resolve_generation, resolve_policy


@dataclass(frozen=True)
class ModelShape:
    """What the processor needs of the checkpoint."""

    latent_channels: int
    spatial_scale: int = 16  # VAE pixels per latent side
    temporal_scale: int = 4  # VAE frames per latent frame (after the first)
    action_dim: int | None = None  # the action tower's width; None: no policy
    use_system_prompt: bool = True
    sound_dim: int | None = None  # the sound tower's width; None: no sound
    sound: Any = None  # the sound decoder's SoundConfig; None: the checkpoint makes no sound


class Cosmos3Processor(Processor):
    """`{"text": ..., "media": [...]}` -> prompt ids (and the conditioning frame); frames and actions out.
    With `chat_context` (the reasoner's context length) text requests go to the reasoner's `TextProcessor`."""

    returns_logprobs = True  # chat answers carry logprobs when asked

    def __init__(self, tokenizer_folder: str | Path, shape: ModelShape, defaults: Cosmos3Defaults,
                 chat_context: int | None = None) -> None:
        from mstar.models.common.text import Tokenizer
        from mstar.models.llama.processor import TextProcessor

        self.tokenizer = Tokenizer.from_pretrained(tokenizer_folder)
        self.shape, self.defaults = shape, defaults
        self.chat = None if chat_context is None else TextProcessor(self.tokenizer, chat_context)
        self.max_model_len = chat_context
        if shape.sound is not None:
            self.sample_rate = shape.sound.sampling_rate

    def output_decoder(self, options: Mapping[str, Any], inputs: Mapping[str, torch.Tensor]) -> OutputDecoder:
        if _is_chat(options) and self.chat is not None:
            return self.chat.output_decoder(options, inputs)
        return OutputDecoder(self, options)

    def validate_options(self, options: Mapping[str, Any]) -> None:
        if _is_chat(options):
            self._chat().validate_options(options)
            return
        policy = _is_policy(options)
        resolve_generation(options, self.defaults, policy)
        if policy:
            self._policy_allowed()
            resolve_policy(options, self.defaults.policy)

    def warm(self) -> None:
        prompts.prompt_ids(self.tokenizer, "warm", True, self.shape.use_system_prompt)

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Prompt ids (and, under guidance, negative ids), the conditioning frame [3, 1, H, W] in [-1, 1];
        writes the resolved options, `layout` and `condition` (whether a frame conditions) into `options`."""
        if _is_chat(options):
            return self._chat().inputs(request, options)
        text = request_text(request)
        if text is None:
            raise ValueError("cosmos3 needs a non-empty text prompt (the task, for a policy)")
        policy = _is_policy(options)
        gen = resolve_generation(options, self.defaults, policy)
        options.update(gen.as_options())
        image = _media_frame(request, policy)
        negative = options.get("negative_prompt") or ""
        if not isinstance(negative, str):
            raise ValueError(f"negative_prompt must be a string, got {type(negative).__name__}")
        if policy:
            out, cond_text, shape = self._policy(image, text, options, gen)
        else:
            out, cond_text, shape = self._generation(image, text, options, gen)
            negative = prompts.with_metadata(negative, shape, negative=True)
        options["condition"] = "image" in out
        system = self.shape.use_system_prompt
        out["prompt_ids"] = torch.tensor(prompts.prompt_ids(self.tokenizer, cond_text, shape.is_image, system))
        if gen.guidance_scale != 1.0:  # as the reference: guidance off exactly at 1
            out["negative_ids"] = torch.tensor(prompts.prompt_ids(self.tokenizer, negative, shape.is_image, system))
        return out

    def _generation(self, image: np.ndarray | None, text: str, options: dict, gen: Generation):
        s = self.shape
        if image is not None and gen.num_frames == 1:
            raise ValueError("an image conditions a video: ask for num_frames > 1 (or modalities ['video'])")
        frames = 1 + (gen.num_frames - 1) // s.temporal_scale
        sound = None
        if "audio" in (options.get("modalities") or ()) and s.sound is not None and s.sound_dim is not None:
            sound = (s.sound_dim, s.sound.steps_for(gen.num_frames, gen.fps))
        layout = Layout(vision=(s.latent_channels, frames, gen.height // s.spatial_scale, gen.width // s.spatial_scale),
                        condition_frames=int(image is not None), sound=sound)
        options["layout"] = layout.to_option()
        out = {} if image is None else {"image": actions.image_condition(image, gen.height, gen.width)[:, None]}
        shape = prompts.Shape(gen.num_frames, gen.height, gen.width, gen.fps)
        return out, prompts.with_metadata(text, shape), shape

    def _policy(self, frame: np.ndarray | None, text: str, options: dict, gen: Generation):
        s = self.shape
        if frame is None:
            raise ValueError("a policy request needs the camera video (or an image) in its media")
        policy = resolve_policy(options, self.defaults.policy)
        if policy.action_width > (s.action_dim or 0):
            raise ValueError(f"embodiment {policy.embodiment!r} has {policy.action_width} action columns; this "
                             f"checkpoint's action tower has {s.action_dim}")
        pixels = actions.frame_pixels(frame, s.spatial_scale)
        canvas = actions.canvas_of(pixels.shape[1], pixels.shape[2], policy.resolution_tier)
        fitted, content = actions.fit_canvas(pixels, canvas)
        num_frames = policy.chunk_size + 1
        layout = Layout(vision=(s.latent_channels, 1 + (num_frames - 1) // s.temporal_scale,
                                *actions.latent_crop(content, s.spatial_scale)),
                        condition_frames=1, action=(policy.chunk_size, s.action_dim),
                        action_width=policy.action_width, domain=policy.domain)
        options.update(layout=layout.to_option(), width=canvas[1], height=canvas[0], num_frames=num_frames,
                       embodiment=policy.embodiment, chunk_size=policy.chunk_size)
        shape = prompts.Shape(num_frames, canvas[0], canvas[1], gen.fps)
        return {"image": fitted[:, None]}, prompts.action_caption(text, shape, policy.view_point), shape

    def _chat(self):
        if self.chat is None:
            raise ValueError("this model answers no text (it has no reasoner); ask for actions, video or images")
        return self.chat

    def _policy_allowed(self) -> None:
        if self.shape.action_dim is None:
            raise ValueError("this checkpoint has no action tower (action_gen is false); it cannot answer 'actions'")

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        if name == "text" and self.chat is not None:
            return self.chat.decode_output(name, tensor, options)
        if name == "progress":
            return float(tensor.reshape(-1)[0])
        return tensor.detach().float().cpu().numpy() if name == "actions" else super().decode_output(name, tensor, options)


def _is_chat(options: Mapping[str, Any]) -> bool:
    return "text" in (options.get("modalities") or ())


def _is_policy(options: Mapping[str, Any]) -> bool:
    return "actions" in (options.get("modalities") or ())


def _media_frame(request: Mapping[str, Any], policy: bool) -> np.ndarray | None:
    """The conditioning frame: a policy's first video frame or image frame; an image-to-video request's image."""
    media = [m for m in request.get("media") or [] if m.get("name") != "mask"]
    if other := sorted({str(m.get("type")) for m in media} - {"image", "video"}):
        raise ValueError(f"cosmos3 reads images and videos, not {other}")
    if not media:
        return None
    if len(media) > 1 and not (policy and all(m["type"] == "image" for m in media)):
        raise ValueError(f"cosmos3 takes one conditioning image or video (a policy also image frames in order), "
                         f"got {len(media)} media parts")
    data = np.asarray(media[0]["data"])
    if media[0]["type"] == "video":
        if not policy:
            raise ValueError("video conditioning is for policy requests (modalities ['actions']); send an image "
                             "to condition a video")
        data = data[0]
    return data[..., :3] if data.ndim == 3 and data.shape[-1] == 4 else data
