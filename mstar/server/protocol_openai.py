"""OpenAI-compatible chat and completion models: requests, responses and stream chunks.

Requests accept fields OpenAI does not define (`extra_body` carries model knobs); `extra_options()` returns
them, and the routes pass them to the model as per-request options once `openai_fields` has checked them.
Sampling fields left unset mean "the model's default"; `response_format` becomes the engine's
`structured_outputs`, and so does a forced tool call (`tool_choice` "required" or a named function).
Features mstar does not implement (legacy `functions`, logit bias) are refused with a clear message
instead of being ignored silently.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mstar.server.protocol import MAX_SEED, MAX_TOKENS_LIMIT, TokenLogprob, Usage
from mstar.server.protocol_openai_messages import AudioOutputParams, ChatMessage, ClosedObject, ToolSpec

MAX_CHOICES = 16  # generations one HTTP request may start (prompts x n), so it cannot take every slot
OBFUSCATION_BLOCK = 128  # bytes: tokens differ in length by less, so most of a stream's events pad to one size

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "ignore_eos", "min_tokens")
_UNSUPPORTED = ("functions", "function_call", "logit_bias")


def new_id(prefix: str) -> str:
    """An OpenAI-style object id such as `chatcmpl-3f2a...`."""
    return f"{prefix}-{uuid.uuid4().hex}"


class SamplingParams(BaseModel):
    """Sampling fields shared by chat and completions; None means the model's default."""

    model_config = ConfigDict(extra="allow")

    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-MAX_SEED - 1, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    user: str | None = None  # accepted and ignored

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 16:
            raise ValueError(f"at most 16 stop sequences, got {len(items)}")
        if any(s == "" for s in items):
            raise ValueError("stop sequences must not be empty strings")
        return v

    @model_validator(mode="after")
    def _check_common(self) -> SamplingParams:
        for name in _UNSUPPORTED:
            if (self.model_extra or {}).get(name):
                raise ValueError(f"`{name}` is not supported by this server; remove it from the request")
        limit = self.token_limit()
        if self.min_tokens is not None and limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed the token limit ({limit})")
        return self

    def token_limit(self) -> int | None:
        """The effective maximum number of generated tokens, or None for the model default."""
        return self.max_tokens

    def stop_list(self) -> list[str]:
        """`stop` as a list (empty when unset)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_options(self) -> dict[str, Any]:
        """The sampling fields the client set, as model options (`max_tokens`, `stop` list, ...)."""
        opts = {k: getattr(self, k) for k in _SAMPLING if getattr(self, k) is not None}
        if self.token_limit() is not None:
            opts["max_tokens"] = self.token_limit()
        if self.stop is not None:
            opts["stop"] = self.stop_list()
        return opts

    def extra_options(self) -> dict[str, Any]:
        """Fields OpenAI does not define: model options, or a 400 (`openai_fields.model_options`)."""
        return dict(self.model_extra or {})


class StreamOptions(ClosedObject):
    """`stream_options`: `include_usage` adds a last chunk with the usage and no choices. `include_obfuscation`
    pads each chunk with an `obfuscation` string of random letters to a multiple of `OBFUSCATION_BLOCK` bytes, so
    one watching the encrypted connection cannot read each token's length off the size of its event. OpenAI pads
    unless told false; mstar pads only when told true (a server on a trusted network need not spend the bytes)."""

    include_usage: bool = False
    include_obfuscation: bool = False

    def pad_to(self) -> int:
        """The block each event's length is padded to a multiple of; 0 for no padding."""
        return OBFUSCATION_BLOCK if self.include_obfuscation else 0


class ChatCompletionRequest(SamplingParams):
    """`POST /v1/chat/completions`."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOutputParams | None = None
    response_format: dict[str, Any] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    # false: a "required" answer is exactly one call; else one or more (an `auto` one any number; a named function
    # is called once)
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        fmt = self.audio.format if self.audio is not None else None
        if self.stream and fmt not in (None, "pcm16") and "audio" in self.output_modalities():
            raise ValueError(f"audio.format {fmt!r} with stream true: a streamed spoken answer comes as pcm16 "
                             f"pieces (as OpenAI streams it); send format pcm16, or stream false for {fmt}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        self.structured_outputs()  # a malformed response_format is a 400 here
        if self.forced_tool() is not None and self.structured_outputs() is not None:
            raise ValueError("a forced tool call (tool_choice required or a function) and a JSON response_format "
                             "exclude each other; leave one out")
        return self

    def tool_mode(self) -> str:
        """"none", "auto" (the default when tools are given), "required", or the name of the one function
        the answer must call; ValueError for a tool_choice that names nothing declared."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        names = [t.function.name for t in self.tools or []]
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if not isinstance(name, str):
                raise ValueError(f"tool_choice={choice!r}: use none, auto, required or "
                                 '{"type": "function", "function": {"name": ...}}')
            choice = name
        elif choice == "none":
            return choice
        if not names:
            raise ValueError(f"tool_choice={self.tool_choice!r} needs `tools`")
        if choice not in ("auto", "required") and choice not in names:
            raise ValueError(f"tool_choice names function {choice!r}, which is not among the tools {names}")
        return choice

    def forced_tool(self) -> str | None:
        """None when the answer may be text; else the function it must call ("" for any of the tools)."""
        mode = self.tool_mode()
        return None if mode in ("none", "auto") else ("" if mode == "required" else mode)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """`tools` as plain dicts (what chat templates and call grammars take), None when there are none."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def structured_outputs(self) -> dict[str, Any] | None:
        """`response_format` as the engine's `structured_outputs` option (None: free text); ValueError for
        one that is not text, json_object or json_schema with a `schema` object. The grammar is always strict."""
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"json_object": True}
        schema = (fmt.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
        if not isinstance(schema, dict):
            raise ValueError(f"response_format {kind!r}: use text, json_object, or json_schema with "
                             "json_schema.schema a JSON schema object")
        return {"json_schema": schema}

    def token_limit(self) -> int | None:
        # OpenAI deprecated max_tokens in favour of max_completion_tokens: the latter wins.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def output_modalities(self) -> list[str]:
        return list(self.modalities or ["text"])


class CompletionRequest(SamplingParams):
    """`POST /v1/completions`."""

    model: str | None = None
    prompt: str | list[str] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)  # only best_of == n (no choosing) is served

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"`best_of` ({self.best_of}) other than n ({self.n}) is not supported (the server does "
                             "not rank candidates); send n alone")
        choices = len(self.prompts()) * self.n
        if choices > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts())} prompts x n={self.n} make {choices} generations; one request "
                             f"may ask for at most {MAX_CHOICES} (send several requests)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.suffix:
            raise ValueError("`suffix` (fill-in-the-middle) is not supported; remove it")
        if self.echo and self.logprobs is not None:
            # the engine keeps logits of sampled tokens only; half an answer would look like a whole one
            raise ValueError("`echo` with `logprobs` (the prompt's logprobs) is not supported; drop one of them")
        return self

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatCompletionAudio(BaseModel):
    """Spoken reply: base64 audio in the requested format plus its transcript."""

    id: str = Field(default_factory=lambda: new_id("audio"))
    data: str
    expires_at: int = 0
    transcript: str = ""


class FunctionCall(BaseModel):
    """The function a call names and its arguments as JSON text; in a stream's deltas each field comes in
    pieces (the name once, the arguments as text to append)."""

    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    """One call in an assistant message."""

    id: str = Field(default_factory=lambda: new_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(BaseModel):
    """A piece of call `index` in a stream: its first piece carries the id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    audio: ChatCompletionAudio | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: str | None = "stop"
    logprobs: ChoiceLogprobs | None = None


class _Answer(BaseModel):
    """What every OpenAI answer object carries first: its id, its kind, when it was made, the model."""

    id: str
    object: str  # each answer narrows it to its own literal
    created: int = Field(default_factory=lambda: int(time.time()))  # seconds since the epoch
    model: str


class ChatCompletion(_Answer):
    """A non-streaming chat answer."""

    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage = Field(default_factory=Usage)
    system_fingerprint: str | None = None

    @property
    def text(self) -> str:
        """The first choice's text ("" when it has none)."""
        return (self.choices[0].message.content or "") if self.choices else ""


class DeltaAudio(BaseModel):
    id: str | None = None
    data: str | None = None  # base64 s16le PCM, mono
    transcript: str | None = None
    expires_at: int | None = None
    sample_rate: int | None = None  # mstar extension: the rate of `data` (OpenAI assumes 24000)


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    audio: DeltaAudio | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Answer):
    """One SSE event of a streaming chat answer; the usage chunk has no choices."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice] = Field(default_factory=list)
    usage: Usage | None = None
    obfuscation: str | None = None  # random letters `sse(..., pad_to)` adds (`stream_options.include_obfuscation`)

    @property
    def text(self) -> str:
        """The new text this event carries (its choices' `delta.content`; "" for role, finish and usage events),
        so `for event in client.chat(..., stream=True): print(event.text, end="")` prints the answer."""
        return "".join(c.delta.content or "" for c in self.choices)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(_Answer):
    """A completion answer, or one streamed piece of it (then `usage` is None until the end)."""

    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: Usage | None = None
    obfuscation: str | None = None  # in a stream, as in ChatCompletionChunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mstar"
    max_model_len: int | None = None
    voices: list[str] = Field(default_factory=list)  # mstar extension: what option `voice` may name
    # mstar extensions: what the model takes and makes, and whether /generate can stream its `progress`
    input_modalities: list[str] = Field(default_factory=list)
    output_modalities: list[str] = Field(default_factory=list)
    reports_progress: bool = False


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
