"""Pi0.5 as a served model: camera images, the robot's state and a task -> an action chunk.

Lane `policy`:  prefix -> act
  prefix   SigLIP over every camera (all robots' cameras in one forward), then the Gemma prefix (image
           tokens, then the prompt: task and discretised state) writes every layer's keys and values
           into the paged prefix cache; carries the prefix's length.
  act      the flow's Euler steps (`num_steps`, 10 by default) in one call: the action expert over the
           request's cached prefix at each step's time, from the request's noise at t = 1, to `actions`
           [chunk, action_dim]; then the prefix's pages are freed.
Requests from many robots batch at every node: all their cameras in one SigLIP forward, their prefixes in
one Gemma forward, their whole flows in one call. `act` is one node, not a Loop of one node per step: each
iteration of a walk's loop is a round trip through the worker and the walk interpreter, and one call lets
the ten steps replay as one CUDA graph (docs/models/pi05.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from mstar.engines.base import StatelessSpec
from mstar.graph import CARRY, ComponentSpec, Emit, Lane, ModelGraph, Node, Sequential, Walk
from mstar.models.base import BuiltComponent, Model
from mstar.models.common.serve_config import LMServeConfig

logger = logging.getLogger(__name__)
PAGE_SIZE = 16  # tokens per page of the prefix cache
_TINY_STD = 0.3  # tiny random weights large enough that inputs visibly change the actions


@dataclass(frozen=True, kw_only=True)
class Pi05ServeConfig(LMServeConfig):
    """How one deployment runs Pi0.5 (YAML `model_kwargs`)."""

    max_robots: int = 64  # prefixes the cache holds at once (requests between prefix and their last step)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.max_robots, bool) or not isinstance(self.max_robots, int) or self.max_robots < 1:
            raise ValueError(f"model_kwargs.max_robots={self.max_robots!r}: use a positive integer")


def _graph() -> ModelGraph:
    vision = Node("vision", inputs=("images",), outputs=("image_tokens",))
    prefix = Node("policy", name="prefix", inputs=("image_tokens", "prompt_ids"), outputs=("prefix_len",))
    flow = Node("policy", name="flow", inputs=("noise", "prefix_len"), outputs=("actions",))
    return ModelGraph(
        components={
            "vision": ComponentSpec("stateless", "SigLIP + projector: every camera image -> Gemma-width tokens"),
            "policy": ComponentSpec("stateless", "Gemma prefix into the paged prefix cache; the action "
                                                 "expert's whole flow over it in one call"),
        },
        walks=(
            Walk("prefix", "policy", Sequential(vision, prefix), inputs=("images", "prompt_ids"),
                 emits=(Emit("prefix_len", CARRY),)),
            Walk("act", "policy", flow, inputs=("noise", "prefix_len"), emits=(Emit("actions"),)),
        ),
        lanes=(Lane("policy", "prefix", {"prefix": "act", "act": None}),),
    )


class Pi05(Model):
    """Pi0.5 from a lerobot folder (--model-path: lerobot/pi05_base or a fine-tune; the tokenizer from
    model_kwargs.tokenizer_path, else the folder), dummy weights (pi05_base's shapes) or --tiny."""

    name = "pi05"
    input_modalities = ("image", "text")
    output_modalities = ("actions",)
    default_options = {"state": [], "num_steps": None, "seed": None}
    extra_options = frozenset({"modalities"})  # ["actions"], as the SDK's predict_actions sends it

    config_class = Pi05ServeConfig

    @cached_property
    def checkpoint(self) -> Path | None:
        """The lerobot folder, or None for random weights."""
        from mstar.models.common.loading import deployment_checkpoint

        return deployment_checkpoint(self.model_path, self.config.tiny, self.load_format, self.name,
                                     "a lerobot Pi0.5 folder or repo id, e.g. lerobot/pi05_base")

    @cached_property
    def pi05(self):
        """The policy's `Pi05Config`."""
        from mstar.models.pi05 import config, tiny, weights

        if self.config.tiny:  # with --model-path too: a tiny checkpoint's weights at the tiny shapes
            return tiny.tiny_config()
        return config.PI05_BASE if self.checkpoint is None else weights.read_config(self.checkpoint)

    def graph(self) -> ModelGraph:
        return _graph()

    def _dtype(self, device: torch.device) -> torch.dtype:
        return torch.float32 if self.config.dtype is None and self.config.tiny else self.config.torch_dtype(device)

    def _part(self, part: str, device: torch.device):
        from mstar.models.pi05 import weights
        from mstar.models.pi05.network import PolicyNet
        from mstar.models.pi05.siglip import VisionTower

        cfg = self.pi05
        if self.checkpoint is not None and self.load_format != "dummy":
            return weights.load_part(self.checkpoint, cfg, part, self._dtype(device), device)
        factory = (lambda: VisionTower(cfg.vision, cfg.llm.width)) if part == "vision" else (lambda: PolicyNet(cfg))
        std = _TINY_STD if self.config.tiny else 0.02
        return weights.build(factory, self._dtype(device), device, None, None, seed=self.config.seed, std=std)

    def build_component(self, name: str, device: torch.device) -> BuiltComponent:
        from mstar.models.pi05.components import PolicyComponent, VisionComponent
        from mstar.models.pi05.prefix_kv import PrefixKVPool

        if name == "vision":
            cameras = len(self.pi05.cameras)  # vision's graphs are per image count: whole robots, and one image
            sizes = sorted({1, *(cameras * n for n in (1, 2, 4, 8, 16) if cameras * n <= 64)})
            return BuiltComponent(VisionComponent(self._part("vision", device)),
                                  StatelessSpec(max_batch_size=64, cuda_graph_sizes=sizes))
        if name == "policy":
            cfg, net = self.pi05, self._part("policy", device)
            pages = self.config.max_robots * -(-cfg.max_prefix_tokens // PAGE_SIZE)
            pool = PrefixKVPool(cfg.llm.depth, cfg.llm.num_kv_heads, cfg.llm.head_dim, pages, PAGE_SIZE,
                                net.llm.embed.weight.dtype, device)
            return BuiltComponent(PolicyComponent(net, pool), StatelessSpec(max_batch_size=self.config.max_robots))
        raise KeyError(f"pi05 has no component {name!r}; components are {sorted(self.graph().components)}")

    def processor(self):
        from mstar.models.pi05 import weights
        from mstar.models.pi05.processor import Pi05Processor, RobotSpec

        cfg = self.pi05
        stats = {}
        if self.checkpoint is not None:
            stats = {"state_stats": weights.read_stats(self.checkpoint, "observation.state"),
                     "action_stats": weights.read_stats(self.checkpoint, "action")}
        robot = RobotSpec(cfg.cameras, cfg.vision.image_size, cfg.state_dim, cfg.action_dim, cfg.chunk_size,
                          cfg.max_state_dim, cfg.max_action_dim, cfg.num_steps, cfg.max_prompt_tokens, **stats)
        return Pi05Processor(robot, self._tokenizer())

    def _tokenizer(self):
        from mstar.models.common.text import Tokenizer
        from mstar.models.pi05.tiny import tiny_tokenizer_folder

        path = self.config.tokenizer_path
        if path is None and self.checkpoint is not None and (self.checkpoint / "tokenizer.json").is_file():
            path = str(self.checkpoint)
        if path is not None:
            from mstar.models.common.loading import resolve_checkpoint

            return Tokenizer.from_pretrained(resolve_checkpoint(path))
        if self.config.tiny or self.checkpoint is None:
            if not self.config.tiny:
                logger.warning("pi05 with dummy weights and no model_kwargs.tokenizer_path: prompts use the tiny "
                               "test tokenizer (other token counts than PaliGemma's)")
            return Tokenizer.from_pretrained(tiny_tokenizer_folder())
        raise ValueError(f"no tokenizer.json in {self.checkpoint}: set model_kwargs.tokenizer_path to a folder or "
                         "repo id holding PaliGemma's tokenizer (google/paligemma-3b-pt-224)")
