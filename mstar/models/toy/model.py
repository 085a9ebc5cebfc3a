"""The toy model: tiny, deterministic, CPU — and it uses every graph primitive.

Lane `text`:  encode -> generate -> render
  encode    Sequential: the encoder turns prompt bytes into a context vector (carried on).
  generate  Loop (dynamic stop, bounded by the request's max_tokens) over
            Sequential(Parallel(cond decoder, uncond decoder), guide): guidance-style combine of
            two branches; the token goes to the client and streams into lane `audio`. With the
            option `report_progress` the guide also emits `progress` (the progress convention of
            `mstar/models/base.py`).
  render    the painter turns the carried tokens into an image and a video (frame stack); only when
            option `modalities` holds "image" or "video" (text always comes: the image is its tokens).
Lane `audio`: vocode — the vocoder reads the token stream through a sliding window and emits
audio samples for the new tokens of each window.
Inputs: text, and image / audio / video media, which the processor folds into the prompt as a few
statistic bytes (see `processor.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from mstar.graph import (
    CARRY,
    ComponentSpec,
    Emit,
    Lane,
    Loop,
    ModelGraph,
    Node,
    Parallel,
    Sequential,
    SlidingWindow,
    StreamEdge,
    Walk,
)
from mstar.models.base import BuiltComponent, Model
from mstar.models.toy import components
from mstar.models.toy.processor import ToyProcessor


@dataclass(frozen=True)
class ToyConfig:
    """Sizes of the toy components; everything is integer-valued, so results are exact."""

    hidden: int = 16
    vocab: int = 256
    image_height: int = 8
    window: int = 4  # vocoder window (tokens)
    stride: int = 2  # vocoder stride (tokens)
    samples_per_token: int = 8
    seed: int = 0
    step_delay_s: float = 0.0  # sleep per decoder step: lets tests cancel or kill mid-request


def _graph(cfg: ToyConfig) -> ModelGraph:
    cond = Node("decoder", inputs=("token", "position", "context"), outputs={"scores": "cond_scores"}, name="cond")
    uncond = Node("decoder", inputs=("token", "position"), outputs={"scores": "uncond_scores"}, name="uncond")
    guide = Node("guide", inputs=("cond_scores", "uncond_scores", "position"),
                 outputs=("token", "generated", "position", "progress"))
    return ModelGraph(
        components={
            "encoder": ComponentSpec("stateless", "prompt bytes -> context vector"),
            "decoder": ComponentSpec("stateless", "(token, context) -> scores over the vocabulary"),
            "guide": ComponentSpec("stateless", "guidance combine of two score vectors -> next token, stop"),
            "painter": ComponentSpec("stateless", "generated tokens -> image and video"),
            "vocoder": ComponentSpec("stateless", "a window of tokens -> audio samples"),
        },
        walks=(
            Walk("encode", "text", Node("encoder", inputs=("prompt_ids",), outputs=("context", "token", "position")),
                 inputs=("prompt_ids",),
                 emits=(Emit("context", CARRY), Emit("token", CARRY), Emit("position", CARRY))),
            Walk("generate", "text",
                 Loop(Sequential(Parallel(cond, uncond), guide), max_iterations="max_tokens", name="decode",
                      accumulate=("generated",)),
                 inputs=("token", "position", "context"),
                 emits=(Emit("token", name="text"), Emit("progress"), Emit("generated", CARRY))),
            Walk("render", "text", Node("painter", inputs=("generated",), outputs=("image", "video")),
                 inputs=("generated",), emits=(Emit("image"), Emit("video"))),
            Walk("vocode", "audio", Node("vocoder", inputs=("codes",), outputs={"audio": "audio"}),
                 inputs=("codes",), emits=(Emit("audio"),)),
        ),
        lanes=(
            Lane("text", "encode", _next_text_walk),
            Lane("audio", lambda opts: "vocode" if "audio" in opts.get("modalities", ()) else None),
        ),
        streams=(StreamEdge("token", "text", "vocode", "codes", SlidingWindow(cfg.window, cfg.stride)),),
    )


def _next_text_walk(finished: str, options: Mapping[str, Any]) -> str | None:
    """encode -> generate -> render, rendering only when option `modalities` asks for image or video."""
    if finished == "encode":
        return "generate"
    wants_pixels = {"image", "video"} & set(options.get("modalities") or ())
    return "render" if finished == "generate" and wants_pixels else None


class ToyModel(Model):
    """Text, image, audio and video in; text, image, audio and video out."""

    name = "toy"
    input_modalities = ("text", "image", "audio", "video")
    output_modalities = ("text", "image", "audio", "video")
    default_options = {"max_tokens": 16, "guidance": 2.0, "stop_early": True, "report_progress": False,
                       "modalities": ["text", "image", "audio", "video"]}
    extra_options = frozenset({"size", "width", "height"})  # the painted image's (processor.painted_size)

    def __init__(self, config: ToyConfig, load_format: str = "auto", model_path: str | None = None) -> None:
        if model_path is not None:  # its weights come from its config's seed: a path would be ignored
            raise ValueError("model 'toy' loads no checkpoint; leave --model-path out")
        super().__init__(config, load_format, model_path)

    @classmethod
    def make_config(cls, tiny: bool = False, **overrides: Any) -> ToyConfig:
        return replace(ToyConfig(), **overrides)

    def graph(self) -> ModelGraph:
        return _graph(self.config)

    def build_component(self, name: str, device: torch.device) -> BuiltComponent:
        builders = {
            "encoder": components.Encoder, "decoder": components.Decoder, "guide": components.Guide,
            "painter": components.Painter, "vocoder": components.Vocoder,
        }
        if name not in builders:
            raise KeyError(f"toy has no component {name!r}; components are {sorted(builders)}")
        return BuiltComponent(builders[name](self.config).to(device))

    def processor(self) -> ToyProcessor:
        return ToyProcessor(self.config)
