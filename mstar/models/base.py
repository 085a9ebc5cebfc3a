"""The model contract: what one folder under mstar/models/ declares.

A model class names its config, declares its graph (components, walks, lanes, streams), builds
each component on a device, and gives a processor that turns requests into tensors and output
tensors into media.

Output conventions the server understands (optional; a model follows them or not):
- `modalities`: a model whose `default_options` holds "modalities" gets the output modalities a
  route wants (e.g. ["audio"] for /v1/audio/speech) in that option, and may skip the others.
- `progress`: a model may emit a client output named "progress", a scalar float in [0, 1] (a
  one-element tensor), any number of times, non-decreasing. A model that does so lists
  "report_progress" (default False) in `default_options`; routes that show progress (the
  /v1/videos jobs) set it to True and read the latest value; nothing else sets it, so plain
  requests pay nothing. The toy emits it once per generated token: tokens so far / max_tokens.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from mstar.engines.base import AutoregressiveSpec, CausalLM, StatelessComponent, StatelessSpec
from mstar.graph import ModelGraph
from mstar.models.common.serve_config import ServeConfig
from mstar.models.common.tool_calls import ToolCallFormat

SpecT = TypeVar("SpecT", AutoregressiveSpec, StatelessSpec)


class OptionError(ValueError):
    """A request option is malformed; `option` names it."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


MAX_OPTION_DEPTH = 8  # lists and mappings inside an option value; deeper is refused before any copy


def check_option_types(defaults: Mapping[str, Any], options: Mapping[str, Any]) -> None:
    """Raise OptionError naming the first option whose value is not of its default's kind (a bool,
    a whole number, a number, a string, a list or a mapping) or nests deeper than MAX_OPTION_DEPTH,
    before any model code reads it."""
    for key, value in options.items():
        default = defaults.get(key)
        kind = _OPTION_KINDS.get(list if isinstance(default, tuple) else type(default))
        if kind is not None and not kind[1](value):
            raise OptionError(key, f"option {key!r} must be {kind[0]}, got {value!r:.80}")
        if _nests_deeper(value, MAX_OPTION_DEPTH):
            raise OptionError(key, f"option {key!r} nests lists or mappings deeper than {MAX_OPTION_DEPTH} levels")


def check_option_names(model: str, accepted: Collection[str], options: Mapping[str, Any]) -> None:
    """Raise OptionError naming the first option `model` does not take (`Model.accepted_options`), with the
    closest name it does take and all of them, since an ignored typo would run at the defaults."""
    for key in options:
        if key not in accepted:
            near = difflib.get_close_matches(str(key), sorted(accepted), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise OptionError(key, f"model {model!r} takes no option {key!r}{hint}; it takes "
                                   f"{', '.join(sorted(accepted)) or 'none'}")


def check_option_support(model: str, processor: Processor, options: Mapping[str, Any]) -> None:
    """Raise OptionError for option `logprobs` when `processor` returns none (`Processor.returns_logprobs`) or
    `structured_outputs` when its engine follows no grammar (`Processor.follows_grammars`): a model may take
    them by name (its sampling options) and still do nothing with them."""
    if options.get("logprobs") is not None and not processor.returns_logprobs:
        raise OptionError("logprobs", f"model {model!r} does not return logprobs; leave them out")
    if options.get("structured_outputs") is not None and not processor.follows_grammars:
        raise OptionError("structured_outputs", f"model {model!r} does not constrain its output to a grammar; "
                                                "leave structured_outputs (response_format) out")


def _nests_deeper(value: Any, levels: int) -> bool:
    if not isinstance(value, list | tuple | dict):
        return False
    if levels == 0:
        return True
    items = value.values() if isinstance(value, dict) else value
    return any(_nests_deeper(v, levels - 1) for v in items)


_OPTION_KINDS = {  # a default's type -> (what to call it, whether a request's value fits)
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
    list: ("a list", lambda v: isinstance(v, list | tuple)),
    dict: ("a mapping", lambda v: isinstance(v, dict)),
}


@dataclass(frozen=True)
class BuiltComponent:
    """A component ready to run: its module and how its engine runs it (the spec of the component's
    engine kind: a stateless component's module is a `StatelessComponent`, an autoregressive one's a
    `CausalLM`)."""

    module: StatelessComponent | CausalLM
    engine: AutoregressiveSpec | StatelessSpec = field(default_factory=StatelessSpec)


@dataclass
class TokenLogprobs:
    """One generated token's log-probability under the model's raw distribution, and (token id,
    log-probability) of the most likely alternatives when the request asked for them."""

    token_id: int
    logprob: float = 0.0
    top: list[tuple[int, float]] = field(default_factory=list)


class OutputDecoder:
    """Per request: turns emitted tensors into client values, in order.

    `push` returns (output name, value) pairs ready for the client: `str` deltas for text, float32
    numpy samples for audio (rate in `Processor.sample_rate`), uint8 HxWx3 arrays for images,
    TxHxWx3 for video, numpy arrays otherwise. When decoding itself ends the request (a stop
    string), `finish_reason` is set and the caller cancels the rest of the request.
    """

    def __init__(self, processor: Processor, options: Mapping[str, Any]) -> None:
        self.processor, self.options = processor, options
        self.finish_reason: str | None = None
        self.prompt_tokens = 0  # for usage
        self.completion_tokens = 0  # text tokens emitted so far, or the request's Processor.generated_stream items
        self.logprobs: list[TokenLogprobs] = []  # per text token, when the request asked (Processor.returns_logprobs)

    def push(self, name: str, value: torch.Tensor) -> list[tuple[str, Any]]:
        if name == "text":
            self.completion_tokens += int(value.numel())
        return [(name, self.processor.decode_output(name, value, self.options))]

    def flush(self) -> list[tuple[str, Any]]:
        """Values held back until the end (e.g. incomplete UTF-8)."""
        return []

    def end(self, streams: Mapping[str, int]) -> None:
        """The request ended, its streams having carried `streams` (target input -> items): the tokens
        of `Processor.generated_stream` count as completion tokens."""
        if self.processor.generated_stream is not None:
            self.completion_tokens += streams.get(self.processor.generated_stream, 0)

    def token_text(self, token_id: int) -> str:
        """The text of one token, as logprobs name it."""
        return str(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token, as logprobs give them (part of a character for some tokens)."""
        return self.token_text(token_id).encode()


class Processor:
    """Turns a request into walk inputs and output tensors into client media.

    A request is a dict with any of: "text" (a prompt string), "messages" (chat messages, roles
    kept, content a string or a list of parts) and "media" (decoded inputs: dicts with "type" in
    image/audio/video and "data" as numpy arrays, plus "sample_rate"/"fps"). `inputs` returns the
    walk inputs by edge name (CPU tensors) and raises ValueError (a 400 for API callers) on
    requests the model cannot take.
    """

    sample_rate: int = 24000  # of audio outputs
    max_model_len: int | None = None  # tokens of prompt and output one sequence may hold; None: not a token model
    returns_logprobs: bool = False  # its decoder fills `OutputDecoder.logprobs` for option `logprobs`
    follows_grammars: bool = False  # its engine constrains text to option `structured_outputs` (engines/grammar.py)
    tool_format: ToolCallFormat | None = None  # how its chat template writes tool calls; None: chat takes no tools
    # the stream (by target input) carrying the tokens the model samples when they reach the client as no text
    # (an LM's audio codes): usage counts its items as completion tokens
    generated_stream: str | None = None

    @property
    def voices(self) -> tuple[str, ...]:
        """The voices a request may name (option `voice`); empty for models that do not speak."""
        return ()

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def validate_options(self, options: Mapping[str, Any]) -> None:
        """Raise ValueError naming the bad option; called before a request is admitted."""

    def limit_context(self, max_model_len: int) -> None:
        """Lower `max_model_len` to what the engine of the model's `context_component` holds, so the 400s
        on prompt and `max_tokens` quote the limit the engine enforces."""
        if self.max_model_len is not None:
            self.max_model_len = min(self.max_model_len, max_model_len)

    def warm(self) -> None:
        """Once, before the server accepts requests: the one-time work the first request would otherwise
        pay (imports, template compiles, a tokenizer's first call). Never touches the model."""

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        # numpy has no bfloat16; float32 holds its values exactly (the wire can send them as bfloat16 again)
        tensor = tensor.detach()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).cpu().numpy()

    def output_decoder(self, options: Mapping[str, Any], inputs: Mapping[str, torch.Tensor]) -> OutputDecoder:
        """A fresh decoder for one request (stateful: detokenizers, stop strings, usage counts)."""
        return OutputDecoder(self, options)


class Model:
    """Base class of every model. Subclasses fill the class attributes and the four methods."""

    name: ClassVar[str]
    input_modalities: ClassVar[tuple[str, ...]] = ("text",)
    output_modalities: ClassVar[tuple[str, ...]] = ("text",)
    # Sampling and other per-request option defaults; each request may override them.
    default_options: ClassVar[Mapping[str, Any]] = {}
    # Options a request may set beyond default_options' keys (those its processor or components read with a
    # built-in default); any other name a client sends is refused (`accepted_options`).
    extra_options: ClassVar[frozenset[str]] = frozenset()
    # The autoregressive component whose context bounds a prompt and its output (`Processor.max_model_len`);
    # its engine's actual limit, lowered to what its KV pool holds, is handed to the processor at start.
    context_component: ClassVar[str | None] = None
    # The voices of the default checkpoint, as `mstar models` lists them without loading it; a server's
    # are its processor's (`Processor.voices`, in /v1/models).
    voices: ClassVar[tuple[str, ...]] = ()
    # The serving config dataclass (`ServeConfig` or a subclass) that the default `make_config` builds.
    config_class: ClassVar[type[ServeConfig]]
    # Components whose build can quantize their weights (YAML `quantization:`, `mstar serve --quantization`).
    quantizable: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any, load_format: str = "auto", model_path: str | None = None) -> None:
        self.config = config
        self.load_format = load_format
        self.model_path = model_path
        # component -> the deployment's engine settings (YAML `engines:`), set by runtime.build.build_model
        self.engine_settings: Mapping[str, Mapping[str, Any]] = {}
        # component -> its weight quantization ("fp8", "fp8_block"; layers/fp8.py), set by build_model
        self.quantization: Mapping[str, str] = {}

    def engine_spec(self, component: str, defaults: SpecT) -> SpecT:
        """The model's engine `defaults` for `component` with the deployment's settings applied: what a
        build that depends on them reads (the batch sizes it captures graphs for). The runtime applies
        them to what `build_component` returns in any case."""
        return dataclasses.replace(defaults, **self.engine_settings.get(component, {}))

    @classmethod
    def make_config(cls, tiny: bool = False, **overrides: Any) -> Any:
        """The default (or tiny) config, a dataclass whose fields are the keys YAML `model_kwargs` may set
        (any other key is refused with the valid ones), with those overrides applied."""
        return dataclasses.replace(cls.config_class(tiny=tiny), **overrides)

    def graph(self) -> ModelGraph:
        """The model's graph; never depends on placement."""
        raise NotImplementedError

    def build_component(self, name: str, device: torch.device) -> BuiltComponent:
        """Build (and load weights for) one component on `device`, with its engine's spec: the model's
        defaults (`engine_spec` where the build reads them)."""
        raise NotImplementedError

    def processor(self) -> Processor:
        raise NotImplementedError

    @classmethod
    def accepted_options(cls) -> frozenset[str]:
        """Every option name a request may set: `default_options`' keys and `extra_options`."""
        return frozenset(cls.default_options) | cls.extra_options

    def request_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Model defaults overridden by the request's options."""
        return {**self.default_options, **options}
