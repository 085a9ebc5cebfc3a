"""V-JEPA 2 and V-JEPA 2-AC as served models.

`vjepa2`, lane `video`:  encode -> [classify]
  encode     the encoder turns a clip into tubelet latents (and their mean, `pooled`).
  classify   when the request asks for `logits` or `label`: the attentive-pooler head of a
             VJEPA2ForVideoClassification checkpoint.
`vjepa2_ac`, lane `world`:  encode -> rollout | plan
  encode     every context frame (and the goal image) encoded on its own and normalised; carried on.
  rollout    a Loop over the horizon of the AC predictor's `step`: the first appends the context to the
             request's KV cache, each later one appends the frame predicted last; every step's frame
             and state are accumulated.
  plan       a Loop over the cross-entropy search's iterations (`cem`): each rolls every candidate
             sequence out in one batch from the request's context cache, scores them against the goal,
             refits; the last returns the actions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from mstar.engines.base import StatelessSpec
from mstar.graph import CARRY, ComponentSpec, Emit, Lane, Loop, ModelGraph, Node, Walk
from mstar.models.base import BuiltComponent, Model
from mstar.models.common.serve_config import ServeConfig
from mstar.models.vjepa2.config import AC_VITG, VITG_FPC64_256, VITL_FPC64_256, VJEPA2Config

_TINY_STD = 0.3  # tiny random weights large enough that inputs visibly change the outputs


@dataclass(frozen=True)
class VJEPA2ServeConfig(ServeConfig):
    """How one deployment runs V-JEPA 2 (YAML `model_kwargs`); request defaults live in the processor."""

    normalize: bool = True  # V-JEPA 2-AC: layer-norm latents before feeding and comparing them, as trained
    # V-JEPA 2-AC on CUDA with cuda_graphs: a rollout of up to `rollout_graph_frames` frames (context plus
    # horizon less one) and a search of up to `plan_graph_samples` candidates over `plan_graph_frames`
    # frames (context less one plus horizon) replay CUDA graphs on caches allocated at start (the plan's:
    # samples x frames x 258 tokens x 24 layers of keys and values); 0 turns that graphed cache off
    rollout_graph_frames: int = 32
    plan_graph_samples: int = 400
    plan_graph_frames: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("rollout_graph_frames", "plan_graph_samples", "plan_graph_frames"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"model_kwargs.{name}={value!r}: use a whole number >= 0")


def _clip_graph() -> ModelGraph:
    encode = Node("encoder", inputs=("video",), outputs=("latents", "pooled"))
    classify = Node("classifier", inputs=("latents",), outputs=("logits", "label"))
    return ModelGraph(
        components={
            "encoder": ComponentSpec("stateless", "V-JEPA 2 ViT: video -> tubelet latents (and their mean)"),
            "classifier": ComponentSpec("stateless", "attentive pooler + linear head: latents -> label logits"),
        },
        walks=(
            Walk("encode", "video", encode, inputs=("video",),
                 emits=(Emit("latents"), Emit("pooled"), Emit("latents", CARRY))),
            Walk("classify", "video", classify, inputs=("latents",), emits=(Emit("logits"), Emit("label"))),
        ),
        lanes=(Lane("video", "encode", lambda done, opts: "classify" if done == "encode" and opts.get("classify")
                    else None),),
    )


def _world_graph() -> ModelGraph:
    encode = Node("encoder", inputs=("frames", "goal"), outputs=("latents", "goal_latents"))
    step = Node("predictor", name="step", inputs=("latents", "states", "actions", "frame", "state"),
                outputs=("frame", "state", "predicted", "predicted_states"))
    cem = Node("predictor", name="cem", inputs=("latents", "states", "history", "goal_latents"),
               outputs=("energy", "progress", "actions"))
    return ModelGraph(
        components={
            "encoder": ComponentSpec("stateless", "V-JEPA 2 ViT: each frame -> normalised patch latents"),
            "predictor": ComponentSpec("stateless", "V-JEPA 2-AC predictor: rollout steps on a KV cache; CEM plans"),
        },
        walks=(
            Walk("encode", "world", encode, inputs=("frames",), optional_inputs=("goal",),
                 emits=(Emit("latents"), Emit("latents", CARRY), Emit("goal_latents", CARRY))),
            Walk("rollout", "world", Loop(step, max_iterations="horizon", name="steps",
                                          accumulate=("predicted", "predicted_states")),
                 inputs=("latents", "states", "actions"), optional_inputs=("frame", "state"),
                 emits=(Emit("predicted"), Emit("predicted_states"))),
            Walk("plan", "world", Loop(cem, max_iterations="cem_iterations", name="search"),
                 inputs=("latents", "states", "goal_latents"), optional_inputs=("history",),
                 emits=(Emit("energy"), Emit("progress"), Emit("actions"))),
        ),
        lanes=(Lane("world", "encode", _next_world_walk),),
    )


def _next_world_walk(finished: str, options: Mapping[str, Any]) -> str | None:
    if finished == "encode" and options.get("task") in ("rollout", "plan"):
        return options["task"]
    return None


class _VJEPA2Base(Model):
    """What both models share: the checkpoint, its configs and building the encoder."""

    _example: str  # what --model-path takes, for the error that asks for it
    _full_size: dict  # the encoder's Hugging Face config.json keys at full size (dummy weights)

    config_class = VJEPA2ServeConfig

    @cached_property
    def checkpoint(self) -> Path | None:
        """The checkpoint (a Hugging Face folder, or an upstream .pt), or None for random weights."""
        from mstar.models.common.loading import deployment_checkpoint

        return deployment_checkpoint(self.model_path, self.config.tiny, self.load_format, self.name, self._example)

    @cached_property
    def vjepa2(self):
        """The encoder's (and mask predictor's, classifier's) config."""
        from mstar.models.vjepa2 import tiny, weights

        if self.checkpoint is not None and self.checkpoint.suffix != ".pt":
            return weights.read_hf_config(self.checkpoint)
        if self.config.tiny:
            return tiny.tiny_config()
        return VJEPA2Config.from_hf(self._full_size)

    def _dtype(self, device: torch.device) -> torch.dtype:
        return torch.float32 if self.config.dtype is None and self.config.tiny else self.config.torch_dtype(device)

    def _build(self, factory, device: torch.device, tensors, mapper):
        from mstar.models.vjepa2.weights import build

        std = _TINY_STD if self.config.tiny else 0.02
        return build(factory, self._dtype(device), device, tensors, mapper, seed=self.config.seed, std=std)

    def _encoder(self, component: Callable[[torch.nn.Module], object], device: torch.device) -> BuiltComponent:
        """The `encoder` node's component: the model's `component` class around the ViT."""
        return BuiltComponent(component(self._part("encoder", device)), StatelessSpec(max_batch_size=8))

    def _part(self, part: str, device: torch.device):
        from mstar.models.vjepa2 import weights

        factory = weights.part_factory(self.vjepa2, part)
        if self.checkpoint is None:
            return self._build(factory, device, None, None)
        if self.checkpoint.suffix == ".pt":
            return self._build(factory, device, weights.upstream_tensors(self.checkpoint, "encoder"),
                               weights.upstream_encoder_mapper)
        return self._build(factory, device, weights.hf_tensors(self.checkpoint), weights.hf_mapper(self.vjepa2, part))


class VJEPA2(_VJEPA2Base):
    """V-JEPA 2 from a Hugging Face folder (--model-path: facebook/vjepa2-vitl-fpc64-256, or a
    ...-ssv2 classifier), dummy weights (ViT-L fpc64-256) or --tiny (with a 5-label head)."""

    name = "vjepa2"
    input_modalities = ("video", "image")
    output_modalities = ("latents", "pooled", "logits", "label")
    default_options = {"modalities": ["latents"]}
    extra_options = frozenset({"num_frames"})
    _example = "a Hugging Face V-JEPA 2 folder or repo id, e.g. facebook/vjepa2-vitl-fpc64-256"
    _full_size = VITL_FPC64_256

    def graph(self) -> ModelGraph:
        return _clip_graph()

    def build_component(self, name: str, device: torch.device) -> BuiltComponent:
        from mstar.models.vjepa2 import components

        if name == "encoder":
            return self._encoder(components.ClipEncoderComponent, device)
        if name == "classifier":
            head = self._part("classifier", device) if self.vjepa2.classifier is not None else None
            return BuiltComponent(components.ClassifierComponent(head))
        raise KeyError(f"vjepa2 has no component {name!r}; components are {sorted(self.graph().components)}")

    def processor(self):
        from mstar.models.vjepa2.processor import ClipShape, VJEPA2Processor

        c, head = self.vjepa2.encoder, self.vjepa2.classifier
        return VJEPA2Processor(ClipShape(c.crop_size, c.frames_per_clip, head.labels if head else ()))


class VJEPA2AC(_VJEPA2Base):
    """V-JEPA 2-AC: a folder holding a Hugging Face V-JEPA 2 encoder and `ac_predictor/` (upstream key
    layout), or the upstream vjepa2-ac-vitg.pt (--model-path); dummy weights (ViT-g + the 24-layer
    predictor) or --tiny."""

    name = "vjepa2_ac"
    input_modalities = ("video", "image")
    output_modalities = ("latents", "predicted", "predicted_states", "actions", "energy")
    default_options = {"modalities": ["latents"], "report_progress": False, "return_sequence": False,
                       "states": [], "actions": []}
    # the task (else told by the request) and the planner's search (processor._search)
    extra_options = frozenset({"task", "horizon", "samples", "topk", "cem_iterations", "maxnorm", "seed"})
    _example = "a folder with a V-JEPA 2 encoder and ac_predictor/, or the upstream vjepa2-ac-vitg.pt"
    _full_size = VITG_FPC64_256

    @cached_property
    def ac_config(self):
        from mstar.models.vjepa2 import tiny, weights

        width = self.vjepa2.encoder.vit.hidden_size
        if self.checkpoint is not None and self.checkpoint.suffix != ".pt":
            return weights.read_ac_config(self.checkpoint, width)
        if self.config.tiny:
            return tiny.tiny_ac_config(width)
        return replace(AC_VITG, embed_dim=width)

    def graph(self) -> ModelGraph:
        return _world_graph()

    def build_component(self, name: str, device: torch.device) -> BuiltComponent:
        from mstar.models.vjepa2 import components, weights
        from mstar.models.vjepa2.ac_predictor import ACPredictor

        if name == "encoder":
            return self._encoder(components.FrameEncoderComponent, device)
        if name == "predictor":
            factory = lambda: ACPredictor(self.ac_config)  # noqa: E731
            if self.checkpoint is None:
                tensors = None
            elif self.checkpoint.suffix == ".pt":
                tensors = weights.upstream_tensors(self.checkpoint, "predictor")
            else:
                tensors = weights.ac_tensors(self.checkpoint)
            predictor = self._build(factory, device, tensors, weights.upstream_ac_mapper)
            c = self.config
            plan_samples = (c.plan_graph_samples,) if c.plan_graph_samples else ()
            world = components.WorldModelComponent(predictor, c.normalize, c.rollout_graph_frames, plan_samples,
                                                   c.plan_graph_frames)
            return BuiltComponent(world, StatelessSpec(graph_buffers=world.graph_buffers()))
        raise KeyError(f"vjepa2_ac has no component {name!r}; components are {sorted(self.graph().components)}")

    def processor(self):
        from mstar.models.vjepa2.processor import ClipShape, PlanDefaults, VJEPA2ACProcessor

        c = self.vjepa2.encoder
        return VJEPA2ACProcessor(ClipShape(c.crop_size, c.frames_per_clip), self.ac_config.action_dim, PlanDefaults())
