"""The pieces of an OpenAI chat request: messages and their content parts (text, image, audio and video), the
tools an answer may call, and how a spoken answer should sound (`audio`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ClosedObject(BaseModel):
    """An object OpenAI defines key by key: a key it does not define is a 400 naming it and the keys there are,
    not dropped unread."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        unknown = [key for key in data if key not in cls.model_fields] if isinstance(data, dict) else []
        if unknown:
            raise ValueError(f"unknown key{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; it takes "
                             f"{', '.join(cls.model_fields)}")
        return data


class MediaURL(ClosedObject):
    """`{"url": ...}`: a data URL, base64, or an http(s) URL when the server allows remote media."""

    url: str = Field(min_length=1)


_DETAIL_NOT_BUILT = {
    "low": "a 512 px copy read for a few tokens",
    "original": "the image read unresized",
}


class ImageURL(MediaURL):
    """`image_url`: where the image is, and how closely to read it. Each image is read at the resolution its
    model's processor sets (within the bounds the checkpoint was trained on): the most detail the model takes,
    which is what "high" asks and what "auto" gets."""

    detail: Literal["auto", "high"] | None = None

    @field_validator("detail", mode="before")
    @classmethod
    def _built(cls, v: Any) -> Any:
        if isinstance(v, str) and v in _DETAIL_NOT_BUILT:
            raise ValueError(f"detail {v!r} ({_DETAIL_NOT_BUILT[v]}) is not built: each image is read at the "
                             "resolution the model's processor sets, which is what 'high' asks; send 'auto' or "
                             "'high'" + (", or downscale the image before sending it" if v == "low" else ""))
        return v


def _url_object(v: Any) -> Any:
    return {"url": v} if isinstance(v, str) else v  # some clients send the bare URL string


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURLPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL

    _wrap = field_validator("image_url", mode="before")(_url_object)


class InputAudio(ClosedObject):
    """Inline audio: base64 `data` in `format`."""

    data: str = Field(min_length=1)
    format: Literal["wav", "mp3", "flac", "ogg", "opus", "aac", "m4a", "webm", "pcm16"]


class InputAudioPart(BaseModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURLPart(BaseModel):
    type: Literal["audio_url"]
    audio_url: MediaURL

    _wrap = field_validator("audio_url", mode="before")(_url_object)


class VideoURLPart(BaseModel):
    type: Literal["video_url"]
    video_url: MediaURL

    _wrap = field_validator("video_url", mode="before")(_url_object)


ContentPart = Annotated[
    TextPart | ImageURLPart | InputAudioPart | AudioURLPart | VideoURLPart, Field(discriminator="type")
]


class ChatMessage(BaseModel):
    """One message; `content` is a string or a list of typed parts."""

    model_config = ConfigDict(extra="allow")  # tool_calls, audio references of earlier turns, ...

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs `content`")
        return self

    def text(self) -> str:
        """The message's text parts joined by newlines."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content or [] if isinstance(p, TextPart))

    def media_parts(self) -> list[ImageURLPart | InputAudioPart | AudioURLPart | VideoURLPart]:
        """The non-text parts, in order."""
        if isinstance(self.content, str) or self.content is None:
            return []
        return [p for p in self.content if not isinstance(p, TextPart)]


class AudioOutputParams(ClosedObject):
    """`audio`: how chat should speak when `modalities` includes "audio". `format` is the container of a whole
    answer (wav when unset); a stream sends pcm16 pieces, so it takes pcm16 alone (as OpenAI's does)."""

    voice: str | None = None
    format: Literal["wav", "mp3", "flac", "opus", "aac", "pcm16"] | None = None

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_id(cls, v: Any) -> Any:
        if isinstance(v, dict):  # OpenAI's custom voice object names the voice by id
            if set(v) != {"id"}:
                raise ValueError(f'a voice object is {{"id": NAME}}, got keys {", ".join(map(repr, v))}')
            return v["id"]
        return v


class FunctionSpec(BaseModel):
    """A callable function: its name, what it does, and its arguments' JSON schema (an object schema)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: forced calls always follow the schema strictly

    @model_validator(mode="after")
    def _check_parameters(self) -> FunctionSpec:
        if self.parameters is not None:
            kind = self.parameters.get("type", "object")
            if kind != "object":
                raise ValueError(f"tool {self.name!r}: parameters must be an object schema, got type {kind!r}")
            problem = schema_problem(self.parameters)
            if problem is not None:
                raise ValueError(f"tool {self.name!r}: parameters{problem}")
        return self


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Where and why `schema` is not a valid JSON schema under its declared draft (2020-12 when it names
    none), as ".path: reason"; None when it is valid."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        best = jsonschema.exceptions.best_match([exc, *exc.context]) if exc.context else exc
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in best.absolute_path)
        return f"{where}: {best.message}"
    return None


class ToolSpec(BaseModel):
    """One entry of `tools`: only functions exist."""

    type: Literal["function"]
    function: FunctionSpec
