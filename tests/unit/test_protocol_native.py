"""Native /generate protocol: request validation, chunk round trips, error bodies."""

import json

import numpy as np
import pytest
from pydantic import ValidationError

from mstar.server.protocol import (
    ActionChunk,
    AudioChunk,
    ErrorChunk,
    FinalChunk,
    GenerateRequest,
    GenerateResponse,
    TensorChunk,
    TextChunk,
    Usage,
    chunk_line,
    error_response,
    parse_chunk,
    validation_message,
)
from mstar.server.streaming import sse


def _message(model, data):
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return validation_message(info.value)


def test_generate_request_defaults_and_media():
    req = GenerateRequest.model_validate(
        {"text": "hi", "media": [{"type": "image", "data": "aGk="}], "options": {"max_tokens": 3}}
    )
    assert req.outputs == ["text"] and req.stream is True and req.options == {"max_tokens": 3}
    assert req.media[0].type == "image"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({}, "needs `text`"),
        ({"text": "x", "outputs": []}, "outputs"),
        ({"text": "x", "outputs": ["audio", "audio"]}, "distinct"),
        ({"text": "x", "media": [{"type": "pdf", "data": "x"}]}, "media.0.type"),
        ({"text": "x", "seed": -1}, "seed"),
        ({"text": "x", "request_id": "has space"}, "request_id"),
        ({"text": "x", "temperature": 0.5}, "temperature"),  # options belong in `options`
        ({"text": "x", "encoding": "msgpack"}, "encoding"),
        ({"text": "x", "tensor_dtype": "float16"}, "tensor_dtype"),
    ],
)
def test_generate_request_rejections_name_the_field(data, needle):
    message, _ = _message(GenerateRequest, data)
    assert needle in message


def test_chunks_roundtrip_through_ndjson():
    samples = np.stack([np.linspace(-1, 1, 50), np.linspace(1, -1, 50)], axis=1).astype(np.float32)
    chunks = [
        TextChunk(output="text", seq=0, delta="héllo 🌍"),
        AudioChunk.from_array("audio", 3, samples, 24000),
        ActionChunk(output="actions", seq=0, values=[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], shape=[2, 3]),
        TensorChunk.from_array("latents", 1, np.arange(12, dtype=np.int16).reshape(3, 4), binary=True),
        ErrorChunk(status=500, message="worker died"),
        FinalChunk(finish_reason="length", usage=Usage(prompt_tokens=4, completion_tokens=6)),
    ]
    lines = b"".join(chunk_line(c) for c in chunks).splitlines()
    parsed = [parse_chunk(line) for line in lines]
    assert [type(p) for p in parsed] == [type(c) for c in chunks]
    assert parsed[0].delta == "héllo 🌍"
    audio = parsed[1]
    assert (audio.sample_rate, audio.channels, audio.encoding, audio.seq) == (24000, 2, "f32le", 3)
    np.testing.assert_array_equal(audio.to_numpy(), samples)
    np.testing.assert_array_equal(parsed[2].to_numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(parsed[3].to_numpy(), np.arange(12).reshape(3, 4))
    assert parsed[5].usage.total_tokens == 10


def test_stream_frames_stay_one_line_when_text_holds_unicode_line_breaks():
    # a random model samples these; httpx's iter_lines, like str.splitlines, breaks on each of them
    delta = "a\u2028b\u2029c\x85d\x1ce\x0bf"
    chunk = TextChunk(output="text", seq=0, delta=delta)
    frames = [chunk_line(chunk), sse(chunk)]
    lines = [[line for line in frame.decode().splitlines() if line] for frame in frames]
    assert [len(one) for one in lines] == [1, 1], frames
    assert parse_chunk(lines[0][0]).delta == delta
    assert json.loads(lines[1][0].removeprefix("data: "))["delta"] == delta


def test_s16le_audio_and_bfloat16_tensor_decode():
    import base64

    pcm = (np.array([0, 16384, -32768], dtype="<i2")).tobytes()
    chunk = AudioChunk(output="a", seq=0, data=base64.b64encode(pcm).decode(), sample_rate=8000, encoding="s16le")
    np.testing.assert_allclose(chunk.to_numpy()[:, 0], [0.0, 0.5, -1.0])
    bf16 = np.array([0x3F80, 0xC000], dtype="<u2").tobytes()  # 1.0, -2.0
    t = TensorChunk(output="t", seq=0, dtype="bfloat16", shape=[2], data=base64.b64encode(bf16).decode())
    np.testing.assert_array_equal(t.to_numpy(), [1.0, -2.0])


def test_bad_chunks_are_rejected():
    for line in (
        '{"type": "text", "output": "text", "seq": -1, "delta": "x"}',
        '{"type": "action", "output": "a", "seq": 0, "values": [1, 2, 3], "shape": [2, 2]}',
        '{"type": "error", "status": 200, "message": "x"}',
        '{"type": "sparkles", "output": "a", "seq": 0}',
        '{"type": "text", "seq": 0, "delta": "x"}',
    ):
        with pytest.raises(ValidationError):
            parse_chunk(line)


def test_generate_response_groups_outputs():
    resp = GenerateResponse.model_validate_json(
        '{"request_id": "r1", "finish_reason": "stop", "outputs": {"text": ['
        '{"type": "text", "output": "text", "seq": 0, "delta": "a"}]}}'
    )
    assert resp.outputs["text"][0].delta == "a" and resp.usage.total_tokens == 0


def test_error_body_shape():
    body = error_response(413, "too big", param="media.0").model_dump()
    assert body == {"error": {"message": "too big", "type": "request_too_large", "param": "media.0", "code": 413}}
    assert error_response(503, "x").error.type == "service_unavailable"
    assert error_response(500, "x").error.type == "server_error"
