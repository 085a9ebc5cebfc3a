"""The model contract: what one folder under mstar/models/ declares.

A model class names its config, declares its graph (components, walks, lanes, streams), builds
each component on a device, and gives a processor that turns requests into tensors and output
tensors into media.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from mstar.graph import ModelGraph


@dataclass
class BuiltComponent:
    """A component ready to run: its module and what its engine needs to know."""

    module: torch.nn.Module  # stateless: implements run_batch(); autoregressive: a CausalLM
    engine_options: dict[str, Any] = field(default_factory=dict)  # e.g. eos ids, default sampling


class Processor:
    """Turns a request into walk inputs and output tensors into client media.

    `inputs` returns the request's input tensors by edge name (CPU tensors) and may add derived
    options; `decode_output` turns one emitted tensor into a plain Python value for the client.
    """

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        return tensor


class Model:
    """Base class of every model. Subclasses fill the class attributes and the four methods."""

    name: ClassVar[str]
    input_modalities: ClassVar[tuple[str, ...]] = ("text",)
    output_modalities: ClassVar[tuple[str, ...]] = ("text",)
    # Sampling and other per-request option defaults; each request may override them.
    default_options: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, config: Any, load_format: str = "auto", model_path: str | None = None) -> None:
        self.config = config
        self.load_format = load_format
        self.model_path = model_path

    @classmethod
    def make_config(cls, tiny: bool = False, **overrides: Any) -> Any:
        """The default (or tiny) config, with overrides from YAML `model_kwargs`."""
        raise NotImplementedError

    def graph(self) -> ModelGraph:
        """The model's graph; never depends on placement."""
        raise NotImplementedError

    def build_component(self, name: str, device: torch.device) -> BuiltComponent:
        """Build (and load weights for) one component on `device`."""
        raise NotImplementedError

    def processor(self) -> Processor:
        raise NotImplementedError

    def request_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Model defaults overridden by the request's options."""
        return {**self.default_options, **options}
