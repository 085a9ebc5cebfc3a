"""OpenAI-compatible request and response models: good requests, clear rejections."""

import pytest
from pydantic import ValidationError

from mstar.server.protocol import MAX_TOKENS_LIMIT, validation_message
from mstar.server.protocol_openai import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatResponseMessage,
    CompletionRequest,
)
from mstar.server.protocol_openai_media import (
    ImageGenerationRequest,
    SpeechRequest,
    TranscriptionRequest,
    VideoCreateRequest,
    parse_size,
)
from mstar.server.protocol_openai_messages import ImageURLPart, InputAudioPart, VideoURLPart

USER = [{"role": "user", "content": "hi"}]


def _message(model, data):
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return validation_message(info.value)


def test_chat_request_with_every_part_and_options():
    req = ChatCompletionRequest.model_validate({
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "what is this"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                {"type": "video_url", "video_url": "https://x/v.mp4"},
            ]},
        ],
        "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": 10, "max_completion_tokens": 20, "temperature": 0.7, "top_p": 0.9, "seed": 7,
        "stop": "END", "n": 2, "logprobs": True, "top_logprobs": 3, "modalities": ["text", "audio"],
        "audio": {"voice": "tara", "format": "pcm16"}, "top_k": 40, "min_p": 0.05,
        "repetition_penalty": 1.1, "ignore_eos": False, "min_tokens": 2, "my_model_knob": 3,
    })
    parts = req.messages[1].media_parts()
    assert [type(p) for p in parts] == [ImageURLPart, InputAudioPart, VideoURLPart]
    assert req.messages[1].text() == "what is this"
    assert req.token_limit() == 20  # max_completion_tokens wins over the deprecated max_tokens
    opts = req.sampling_options()
    assert opts["max_tokens"] == 20 and opts["stop"] == ["END"] and opts["top_k"] == 40 and opts["seed"] == 7
    assert "n" not in opts and req.extra_options() == {"my_model_knob": 3}
    assert req.output_modalities() == ["text", "audio"]


def test_unset_sampling_fields_mean_model_defaults():
    req = ChatCompletionRequest.model_validate({"messages": USER})
    assert req.sampling_options() == {} and req.n == 1 and not req.stream


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1 (got 0)"),
        ({"max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens"),
        ({"temperature": 2.5}, "temperature: Input should be less than or equal to 2"),
        ({"n": 17}, "n: Input should be less than or equal to 16"),
        ({"n": 0}, "n:"),
        ({"top_p": 0}, "top_p"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "needs `content`"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages.0.content.0.image_url.url"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x",
                                                     "format": "midi"}}]}]}, "format"),
        ({"stop": ["a", ""]}, "must not be empty"),
        ({"stream_options": {"include_usage": True}}, "only allowed when stream"),
        ({"top_logprobs": 2}, "needs logprobs"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens (5) must not exceed"),
        ({"tools": [{"type": "function"}]}, "tools.0.function: Field required"),
        ({"functions": [{"name": "f"}]}, "`functions` is not supported"),
        ({"tool_choice": "required"}, "needs `tools`"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                   "required": "a"}}}]},
         "tool 'f': parameters.required: 'a' is not of type 'array'"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"anyOf": 3}}}]},
         "tool 'f': parameters.anyOf: 3 is not of type 'array'"),
        ({"tools": [{"type": "function", "function": {"name": "g", "parameters": {
            "type": "object", "properties": {"a": {"type": "array", "items": {"type": "strng"}}}}}}]},
         "tool 'g': parameters.properties.a.items.type: 'strng' is not one of"),
        ({"tools": [{"type": "function", "function": {"name": "h", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": "1"}}}}}]},
         "tool 'h': parameters.properties.n.minimum: '1' is not of type 'number'"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema a JSON schema object"),
        ({"response_format": {"type": "yaml"}}, "use text, json_object, or json_schema"),
        ({"modalities": ["smell"]}, "modalities"),
    ],
)
def test_chat_rejections_are_clear(patch, needle):
    message, param = _message(ChatCompletionRequest, {"messages": USER, **patch})
    assert needle in message, message
    assert param is None or param.split(".")[0] in (*patch, "messages")


def test_response_format_becomes_structured_outputs():
    def structured(fmt):
        return ChatCompletionRequest.model_validate({"messages": USER, "response_format": fmt}).structured_outputs()

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert structured({"type": "text"}) is None and structured({"type": "json_object"}) == {"json_object": True}
    assert structured({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}) == {
        "json_schema": schema}


def test_completion_request():
    req = CompletionRequest.model_validate({"prompt": ["a", "b"], "max_tokens": 5, "logprobs": 2})
    assert req.prompts() == ["a", "b"] and req.sampling_options() == {"max_tokens": 5}
    assert "suffix" in _message(CompletionRequest, {"prompt": "a", "suffix": "z"})[0]
    assert "echo" in _message(CompletionRequest, {"prompt": "a", "echo": True, "logprobs": 1})[0]
    assert CompletionRequest.model_validate({"prompt": "a", "echo": True}).echo  # echo alone is served
    assert "prompt" in _message(CompletionRequest, {"prompt": ""})[0]


def test_completion_best_of_above_n_is_refused_not_ignored():
    assert "best_of" in _message(CompletionRequest, {"prompt": "a", "best_of": 3})[0]
    assert "best_of" in _message(CompletionRequest, {"prompt": "a", "n": 2, "best_of": 4})[0]
    same = CompletionRequest.model_validate({"prompt": "a", "n": 2, "best_of": 2})  # best of n is n: served
    assert same.n == 2 and "best_of" not in same.sampling_options() | same.extra_options()


def test_chat_responses_serialise_like_openai():
    done = ChatCompletion(model="m", choices=[{"message": ChatResponseMessage(content="hey"), "finish_reason": "stop"}],
                          usage={"prompt_tokens": 3, "completion_tokens": 2})
    body = done.model_dump()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert done.text == "hey"
    chunk = ChatCompletionChunk(id="c1", model="m", choices=[{"delta": {"content": "h"}}])
    again = ChatCompletionChunk.model_validate_json(chunk.model_dump_json())
    assert again.choices[0].delta.content == "h" and again.usage is None


def test_speech_request():
    req = SpeechRequest.model_validate({"input": "hello", "voice": {"id": "tara"}, "response_format": "pcm",
                                        "stream_format": "sse", "speed": 1.5, "repetition_penalty": 1.1})
    assert req.voice == "tara" and req.extra_options() == {"repetition_penalty": 1.1}
    assert SpeechRequest(input="x").response_format == "mp3"
    assert "response_format" in _message(SpeechRequest, {"input": "x", "response_format": "ogg"})[0]
    assert "speed" in _message(SpeechRequest, {"input": "x", "speed": 5})[0]
    assert "input" in _message(SpeechRequest, {"input": ""})[0]


def test_image_request_sizes():
    req = ImageGenerationRequest.model_validate({"prompt": "cat", "size": "512x768", "n": 2})
    assert req.dimensions() == (512, 768)
    assert ImageGenerationRequest(prompt="cat", size="auto").dimensions() is None
    assert "WIDTHxHEIGHT" in _message(ImageGenerationRequest, {"prompt": "cat", "size": "big"})[0]
    assert _message(ImageGenerationRequest, {"prompt": "cat", "size": "big"})[0].count("'big'") == 1  # said once
    assert "between 1 and" in _message(ImageGenerationRequest, {"prompt": "cat", "size": "0x10"})[0]
    assert "use b64_json" in _message(ImageGenerationRequest, {"prompt": "cat", "response_format": "url"})[0]
    # Form fields arrive as strings; lax parsing converts them.
    assert ImageGenerationRequest.model_validate({"prompt": "c", "n": "3"}).n == 3


@pytest.mark.parametrize("field,value", [("background", "transparent"), ("quality", "hd"), ("quality", "low"),
                                         ("style", "vivid"), ("output_compression", 50)])
def test_image_settings_the_server_cannot_honour_are_refused(field, value):
    """Every image comes out opaque at the model's own quality: asking otherwise is a 400, not ignored."""
    assert field in _message(ImageGenerationRequest, {"prompt": "cat", field: value})[0]


def test_image_settings_that_ask_for_the_default_and_compression_for_jpeg_are_served():
    for field, value in (("background", "auto"), ("background", "opaque"), ("quality", "auto"),
                         ("quality", "standard")):
        assert ImageGenerationRequest.model_validate({"prompt": "cat", field: value})
    req = ImageGenerationRequest.model_validate({"prompt": "c", "output_format": "jpeg", "output_compression": "40"})
    assert req.output_compression == 40 and "output_compression" not in req.extra_options()
    assert "output_compression" in _message(ImageGenerationRequest, {"prompt": "c", "output_format": "webp",
                                                                    "output_compression": 101})[0]


def test_video_and_transcription_requests():
    req = VideoCreateRequest.model_validate({"prompt": "waves", "seconds": "4", "size": "1280x720"})
    assert req.seconds == 4.0 and req.dimensions() == (1280, 720)
    assert "seconds" in _message(VideoCreateRequest, {"prompt": "w", "seconds": 0})[0]
    assert parse_size(" 64 X 32 ") == (64, 32)
    assert TranscriptionRequest.model_validate({"language": "en", "temperature": "0.2"}).temperature == 0.2
    assert "language" in _message(TranscriptionRequest, {"language": "english!"})[0]


def _chat(**patch):
    return ChatCompletionRequest.model_validate({"messages": USER, **patch})


def _image(image_url) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": image_url}]}]}


def test_image_detail_auto_and_high_are_served_and_low_and_original_refused():
    """Images are read at the resolution the model's processor sets (what "high" asks): low and original were
    accepted and ignored."""
    for detail in (None, "auto", "high"):
        req = ChatCompletionRequest.model_validate(_image({"url": "data:,x", "detail": detail}))
        assert req.messages[0].media_parts()[0].image_url.detail == detail
    for detail in ("low", "original"):
        message, param = _message(ChatCompletionRequest, _image({"url": "data:,x", "detail": detail}))
        assert f"detail {detail!r}" in message and "not built" in message and "'auto' or 'high'" in message, message
        assert param == "messages.0.content.0.image_url.detail"
    for detail in ("max", {"a": 1}, ["low"]):  # a 400 naming the field, never a 500
        assert "image_url.detail" in _message(ChatCompletionRequest, _image({"url": "data:,x", "detail": detail}))[0]


@pytest.mark.parametrize(("patch", "needle"), [
    (_image({"url": "data:,x", "details": "high"}), "image_url: unknown key 'details'; it takes url, detail"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "v", "detail": "high"}}]}]},
     "video_url: unknown key 'detail'; it takes url"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": "AAAA", "format": "wav", "rate": 8000}}]}]}, "input_audio: unknown key 'rate'; it takes data, format"),
    ({"stream": True, "stream_options": {"include_usage": True, "include_usag": True, "chunk": 1}},
     "stream_options: unknown keys 'include_usag', 'chunk'; it takes include_usage, include_obfuscation"),
    ({"audio": {"voice": "tara", "speed": 2}}, "audio: unknown key 'speed'; it takes voice, format"),
    ({"audio": {"voice": {"id": "tara", "age": 3}}}, "a voice object is {\"id\": NAME}"),
])
def test_unknown_keys_in_nested_openai_objects_are_refused_by_name(patch, needle):
    message, param = _message(ChatCompletionRequest, {"messages": USER, **patch})
    assert needle in message, message
    assert param is not None and param.split(".")[0] in patch


def test_stream_options_take_both_openai_keys():
    plain = _chat(stream=True, stream_options={"include_usage": True})
    assert plain.stream_options.include_usage and plain.stream_options.pad_to() == 0
    padded = _chat(stream=True, stream_options={"include_obfuscation": True})
    assert not padded.stream_options.include_usage and padded.stream_options.pad_to() > 0
    assert _chat(stream=True, stream_options={"include_obfuscation": False}).stream_options.pad_to() == 0
    assert CompletionRequest.model_validate({"prompt": "a", "stream": True,
                                             "stream_options": {"include_obfuscation": True}}).stream_options.pad_to()


def test_spoken_chat_audio_format_and_voice():
    """A whole answer takes any of OpenAI's containers (wav unset); a stream sends pcm16 pieces, so it takes
    pcm16 alone, as OpenAI's does: wav was accepted and pcm16 sent."""
    spoken = {"modalities": ["text", "audio"]}
    assert _chat(**spoken, audio={"voice": "tara", "format": "mp3"}).audio.format == "mp3"
    assert _chat(**spoken, stream=True, audio={"voice": "tara", "format": "pcm16"}).audio.format == "pcm16"
    assert _chat(**spoken, stream=True, audio={"voice": "tara"}).audio.format is None
    assert _chat(**spoken, audio={"voice": {"id": "tara"}}).audio.voice == "tara"  # OpenAI's custom voice object
    message, _ = _message(ChatCompletionRequest, {"messages": USER, **spoken, "stream": True,
                                                  "audio": {"voice": "tara", "format": "wav"}})
    assert "audio.format 'wav' with stream true" in message and "send format pcm16" in message
    assert "audio.format" in _message(ChatCompletionRequest, {"messages": USER, "audio": {"format": "midi"}})[0]


def test_include_obfuscation_pads_each_event_to_a_whole_block():
    """`include_obfuscation` asks for events whose sizes do not tell each token's length; none was padded."""
    import string

    from mstar.server.protocol_openai import OBFUSCATION_BLOCK
    from mstar.server.streaming import sse

    def event(text: str, pad: int) -> bytes:
        chunk = ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[{"delta": {"content": text}}])
        return sse(chunk, pad).removeprefix(b"data: ").removesuffix(b"\n\n")

    for text in ("", "a", "h\u00e9llo\u2028", "x" * 300):
        data = event(text, OBFUSCATION_BLOCK)
        assert len(data) % OBFUSCATION_BLOCK == 0, (text, len(data))
        again = ChatCompletionChunk.model_validate_json(data)
        assert again.choices[0].delta.content == text
        assert set(again.obfuscation) <= set(string.ascii_letters + string.digits)
    assert len(event("a", OBFUSCATION_BLOCK)) == len(event("token", OBFUSCATION_BLOCK))
    assert b"obfuscation" not in event("a", 0) and len(event("a", 0)) < len(event("token", 0))
